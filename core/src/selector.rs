//! A Kubernetes label selector (`metav1.LabelSelector`): `matchLabels` and `matchExpressions`
//! with the operators `In`, `NotIn`, `Exists` and `DoesNotExist`, matched against a label map
//! with Kubernetes' meaning: every requirement must hold, `NotIn` and `DoesNotExist` hold for
//! an absent label, and an empty selector matches every label set. An IPPool's
//! `namespaceSelector` is one; it is written the way a NetworkPolicy's is, so `kubectl`,
//! Helm values and the CRD's schema need nothing new. [`std::fmt::Display`] renders it the
//! way `kubectl get -l` takes it (`tenant=a,env in (dev,test),!legacy`), for messages.
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Most values one requirement may list.
const MAX_VALUES: usize = 64;

#[derive(
    Debug,
    Clone,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels that must all be present with these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Requirements that must all hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

/// One `matchExpressions` entry.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(deny_unknown_fields)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    /// Values of `In` / `NotIn` (at least one); empty for `Exists` / `DoesNotExist`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// A selector Kubernetes would refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("matchExpressions[{index}]: an empty key")]
    EmptyKey { index: usize },
    #[error("matchLabels: an empty key")]
    EmptyLabelKey,
    #[error("matchExpressions[{index}] ({key} {operator:?}): {what}")]
    Values {
        index: usize,
        key: String,
        operator: Operator,
        what: &'static str,
    },
}

impl LabelSelector {
    /// Checks what Kubernetes checks of a LabelSelector: keys not empty, `In`/`NotIn` with
    /// values (at most [`MAX_VALUES`]), `Exists`/`DoesNotExist` without.
    pub fn validate(&self) -> Result<(), SelectorError> {
        if self.match_labels.keys().any(String::is_empty) {
            return Err(SelectorError::EmptyLabelKey);
        }
        for (index, r) in self.match_expressions.iter().enumerate() {
            if r.key.is_empty() {
                return Err(SelectorError::EmptyKey { index });
            }
            let what = match r.operator {
                Operator::In | Operator::NotIn if r.values.is_empty() => {
                    Some("needs at least one value")
                }
                Operator::In | Operator::NotIn if r.values.len() > MAX_VALUES => {
                    Some("more than 64 values")
                }
                Operator::Exists | Operator::DoesNotExist if !r.values.is_empty() => {
                    Some("takes no values")
                }
                _ => None,
            };
            if let Some(what) = what {
                return Err(SelectorError::Values {
                    index,
                    key: r.key.clone(),
                    operator: r.operator,
                    what,
                });
            }
        }
        Ok(())
    }

    /// Whether a set of `labels` satisfies every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }
}

impl Requirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.contains(v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = self
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        for r in &self.match_expressions {
            parts.push(match r.operator {
                Operator::In => format!("{} in ({})", r.key, r.values.join(",")),
                Operator::NotIn => format!("{} notin ({})", r.key, r.values.join(",")),
                Operator::Exists => r.key.clone(),
                Operator::DoesNotExist => format!("!{}", r.key),
            });
        }
        if parts.is_empty() {
            return f.write_str("{} (every namespace)");
        }
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn parse(json: &str) -> LabelSelector {
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    #[test]
    fn matches_as_kubernetes_does() {
        let s = parse(
            r#"{"matchLabels": {"tenant": "a"},
                "matchExpressions": [
                    {"key": "env", "operator": "In", "values": ["dev", "test"]},
                    {"key": "tier", "operator": "NotIn", "values": ["db"]},
                    {"key": "team", "operator": "Exists"},
                    {"key": "legacy", "operator": "DoesNotExist"}]}"#,
        );
        s.validate().expect("valid");
        let base = [("tenant", "a"), ("env", "dev"), ("team", "x")];
        assert!(s.matches(&labels(&base)));
        // NotIn holds for an absent label, and for another value.
        assert!(s.matches(&labels(&[("tier", "web"), base[0], base[1], base[2]])));
        for bad in [
            vec![("tenant", "b"), base[1], base[2]],
            vec![base[1], base[2]],
            vec![base[0], ("env", "prod"), base[2]],
            vec![base[0], base[2]],
            vec![base[0], base[1], base[2], ("tier", "db")],
            vec![base[0], base[1]],
            vec![base[0], base[1], base[2], ("legacy", "")],
        ] {
            assert!(!s.matches(&labels(&bad)), "{bad:?}");
        }
        assert!(LabelSelector::default().matches(&labels(&[])));
        assert_eq!(
            s.to_string(),
            "tenant=a,env in (dev,test),tier notin (db),team,!legacy"
        );
    }

    #[test]
    fn refuses_what_kubernetes_refuses() {
        for (json, says) in [
            (
                r#"{"matchExpressions": [{"key": "a", "operator": "In", "values": []}]}"#,
                "needs at least one value",
            ),
            (
                r#"{"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}"#,
                "takes no values",
            ),
            (
                r#"{"matchExpressions": [{"key": "", "operator": "Exists"}]}"#,
                "empty key",
            ),
            (r#"{"matchLabels": {"": "x"}}"#, "empty key"),
        ] {
            let e = parse(json).validate().expect_err(json);
            assert!(e.to_string().contains(says), "{json}: {e}");
        }
        for json in [
            r#"{"matchExpressions": [{"key": "a", "operator": "Like", "values": ["x"]}]}"#,
            r#"{"matchLabel": {"a": "b"}}"#,
        ] {
            assert!(
                serde_json::from_str::<LabelSelector>(json).is_err(),
                "{json}"
            );
        }
    }
}
