//! A minimal libcni for conflists: each plugin exec'd in a node's namespace the way a runtime
//! does ([`plugin_call`]).
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::cni::{plugin_call, CniOutput, CNI_DIR};
use crate::{bin, Node};

/// A minimal libcni: runs a conflist's plugins in order for ADD (each gets the previous result
/// as `prevResult`, and the `runtimeConfig` keys its `capabilities` ask for), and in reverse for
/// DEL/CHECK with the cached result. `calix` is the binary under test; every other type comes
/// from Debian's reference plugins in /usr/lib/cni.
pub struct ConfList {
    pub list: Value,
}

impl ConfList {
    fn plugin_conf(&self, i: usize, prev: Option<&Value>, rc: &Value) -> (PathBuf, Value) {
        let mut p = self.list["plugins"][i].clone();
        let ty = p["type"].as_str().unwrap_or_default().to_string();
        let path = if ty == "calix" {
            bin("calix")
        } else {
            Path::new(CNI_DIR).join(&ty)
        };
        let caps: Vec<String> = p["capabilities"]
            .as_object()
            .map(|c| {
                c.iter()
                    .filter(|(_, v)| v.as_bool() == Some(true))
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default();
        if let Some(obj) = p.as_object_mut() {
            obj.insert("name".into(), self.list["name"].clone());
            obj.insert("cniVersion".into(), self.list["cniVersion"].clone());
            if let Some(prev) = prev {
                obj.insert("prevResult".into(), prev.clone());
            }
            let mut runtime = serde_json::Map::new();
            for c in caps {
                if let Some(v) = rc.get(&c) {
                    runtime.insert(c, v.clone());
                }
            }
            if !runtime.is_empty() {
                obj.insert("runtimeConfig".into(), Value::Object(runtime));
            }
        }
        (path, p)
    }

    fn len(&self) -> usize {
        self.list["plugins"].as_array().map_or(0, Vec::len)
    }

    /// ADD through every plugin; returns the final result or the failing call.
    pub fn add(
        &self,
        node: &Node,
        cid: &str,
        netns: &str,
        args: &str,
        rc: &Value,
    ) -> Result<Value, CniOutput> {
        let mut prev: Option<Value> = None;
        for i in 0..self.len() {
            let (path, conf) = self.plugin_conf(i, prev.as_ref(), rc);
            let conf = conf.to_string();
            let out = plugin_call(&node.ns, &path, "ADD", cid, netns, "eth0", args, &conf);
            if !out.success {
                return Err(out);
            }
            prev = out.json;
        }
        Ok(prev.unwrap_or(Value::Null))
    }

    /// DEL or CHECK through every plugin in reverse, with the cached ADD result.
    #[allow(clippy::too_many_arguments)]
    pub fn run_reverse(
        &self,
        node: &Node,
        command: &str,
        cid: &str,
        netns: &str,
        args: &str,
        rc: &Value,
        cached: Option<&Value>,
    ) -> Result<(), CniOutput> {
        for i in (0..self.len()).rev() {
            let (path, conf) = self.plugin_conf(i, cached, rc);
            let conf = conf.to_string();
            let out = plugin_call(&node.ns, &path, command, cid, netns, "eth0", args, &conf);
            if !out.success {
                return Err(out);
            }
        }
        Ok(())
    }
}
