//! The Prometheus text format's rule every renderer of the agent's `/metrics` shares.

/// `s` as a Prometheus label value: backslash, double quote and newline escaped.
pub(crate) fn label_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_label_value_cannot_end_its_quotes_or_its_line() {
        assert_eq!(super::label_value("ns/web"), "ns/web");
        assert_eq!(super::label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
