//! The CNI result, rendered for the version the runtime asked for.
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{json, Value};

use crate::error::{code, CniError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub mac: [u8; 6],
    /// The netns path for interfaces inside the container.
    pub sandbox: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddResult {
    pub interfaces: Vec<Interface>,
    /// (address with prefix, gateway, index into `interfaces`)
    pub ips: Vec<(IpNet, IpAddr, usize)>,
    /// (destination, gateway)
    pub routes: Vec<(IpNet, IpAddr)>,
}

impl AddResult {
    /// Parses a result of any supported version (a `prevResult`, a delegate's answer).
    pub fn from_json(v: &Value) -> Result<Self, CniError> {
        let bad = |what: String| {
            CniError::new(
                code::DECODE_FAILURE,
                format!("cannot decode prevResult: {what}"),
                "",
            )
        };
        let mut r = AddResult {
            interfaces: Vec::new(),
            ips: Vec::new(),
            routes: Vec::new(),
        };
        for i in v["interfaces"].as_array().into_iter().flatten() {
            let name = i["name"]
                .as_str()
                .ok_or_else(|| bad(format!("interface without a name: {i}")))?;
            let mac = i["mac"]
                .as_str()
                .and_then(calix_kernel::mac::parse)
                .unwrap_or([0; 6]);
            r.interfaces.push(Interface {
                name: name.to_string(),
                mac,
                sandbox: i["sandbox"].as_str().map(String::from),
            });
        }
        for ip in v["ips"].as_array().into_iter().flatten() {
            let addr: IpNet = ip["address"]
                .as_str()
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| bad(format!("bad ip entry {ip}")))?;
            let gw: IpAddr = ip["gateway"]
                .as_str()
                .and_then(|g| g.parse().ok())
                .unwrap_or(if addr.addr().is_ipv4() {
                    IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
                } else {
                    IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
                });
            let idx = ip["interface"].as_u64().unwrap_or(0) as usize;
            r.ips.push((addr, gw, idx));
        }
        for rt in v["routes"].as_array().into_iter().flatten() {
            let dst: IpNet = rt["dst"]
                .as_str()
                .and_then(|d| d.parse().ok())
                .ok_or_else(|| bad(format!("bad route {rt}")))?;
            let gw: IpAddr =
                rt["gw"]
                    .as_str()
                    .and_then(|g| g.parse().ok())
                    .unwrap_or(if dst.addr().is_ipv4() {
                        IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
                    } else {
                        IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
                    });
            r.routes.push((dst, gw));
        }
        Ok(r)
    }

    /// `self` placed after an earlier plugin's result (chaining): the earlier entries first,
    /// our interface indices shifted past theirs.
    pub fn after(self, prev: AddResult) -> AddResult {
        let shift = prev.interfaces.len();
        let mut out = prev;
        out.interfaces.extend(self.interfaces);
        out.ips
            .extend(self.ips.into_iter().map(|(a, g, i)| (a, g, i + shift)));
        out.routes.extend(self.routes);
        out
    }

    /// The JSON for `version`: 0.3.x/0.4.0 carry `"version"` on each IP; 1.x does not.
    pub fn to_json(&self, version: &str) -> Value {
        let version = if version.is_empty() {
            crate::version::LATEST
        } else {
            version
        };
        let pre1 = version.starts_with("0.");
        let interfaces: Vec<Value> = self
            .interfaces
            .iter()
            .map(|i| {
                let mut v = json!({ "name": i.name, "mac": calix_kernel::mac::format(&i.mac) });
                if let Some(s) = &i.sandbox {
                    v["sandbox"] = json!(s);
                }
                v
            })
            .collect();
        let ips: Vec<Value> = self
            .ips
            .iter()
            .map(|(addr, gw, idx)| {
                let mut v = json!({ "address": addr.to_string(), "gateway": gw.to_string(), "interface": idx });
                if pre1 {
                    v["version"] = json!(if addr.addr().is_ipv4() { "4" } else { "6" });
                }
                v
            })
            .collect();
        let routes: Vec<Value> = self
            .routes
            .iter()
            .map(|(dst, gw)| json!({ "dst": dst.to_string(), "gw": gw.to_string() }))
            .collect();
        json!({
            "cniVersion": version,
            "interfaces": interfaces,
            "ips": ips,
            "routes": routes,
            "dns": {},
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AddResult {
        AddResult {
            interfaces: vec![
                Interface {
                    name: "cali0123456789a".into(),
                    mac: calix_kernel::pod::HOST_VETH_MAC,
                    sandbox: None,
                },
                Interface {
                    name: "eth0".into(),
                    mac: [2, 0, 0, 0, 0, 1],
                    sandbox: Some("/run/netns/p".into()),
                },
            ],
            ips: vec![(
                "10.1.0.5/32".parse().expect("net"),
                "169.254.1.1".parse().expect("ip"),
                1,
            )],
            routes: vec![(
                "0.0.0.0/0".parse().expect("net"),
                "169.254.1.1".parse().expect("ip"),
            )],
        }
    }

    #[test]
    fn renders_v1() {
        let v = sample().to_json("1.1.0");
        assert_eq!(v["cniVersion"], "1.1.0");
        assert_eq!(v["interfaces"][0]["mac"], "ee:ee:ee:ee:ee:ee");
        assert_eq!(v["interfaces"][1]["sandbox"], "/run/netns/p");
        assert_eq!(v["ips"][0]["address"], "10.1.0.5/32");
        assert_eq!(v["ips"][0]["interface"], 1);
        assert!(v["ips"][0].get("version").is_none());
        assert_eq!(v["routes"][0]["dst"], "0.0.0.0/0");
    }

    #[test]
    fn renders_pre_v1_with_ip_version() {
        let v = sample().to_json("0.3.1");
        assert_eq!(v["cniVersion"], "0.3.1");
        assert_eq!(v["ips"][0]["version"], "4");
    }

    #[test]
    fn parses_any_version_and_chains() {
        let ours = sample();
        for v in crate::version::SUPPORTED {
            let back = AddResult::from_json(&ours.to_json(v)).expect("parse");
            assert_eq!(back, ours, "{v}");
        }
        let prev = AddResult {
            interfaces: vec![Interface {
                name: "lo".into(),
                mac: [0; 6],
                sandbox: Some("/x".into()),
            }],
            ips: vec![],
            routes: vec![],
        };
        let chained = sample().after(prev);
        assert_eq!(chained.interfaces.len(), 3);
        assert_eq!(chained.ips[0].2, 2);
        assert!(AddResult::from_json(&serde_json::json!({"ips":[{"address":"nope"}]})).is_err());
    }
}
