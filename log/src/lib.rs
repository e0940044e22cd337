//! Log and terminal hygiene. Much of what calix logs or prints comes from outside: pod names
//! and namespaces from CNI_ARGS or the datastore, interface names, error texts of other tools.
//! A newline in a pod name must not forge a log line, and an escape sequence must not drive
//! the operator's terminal. Every log line goes through [`EscapingWriter`], and calixctl
//! prints every table cell through [`escape_control`].
use std::borrow::Cow;
use std::io::{self, Write};

/// `s` with every control character (C0, DEL and C1: newlines, carriage returns, tabs, ESC...)
/// written as a Rust-style escape (`\n`, `\t`, `\u{1b}`); borrowed when there is none.
pub fn escape_control(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A writer for one formatted log line at a time (tracing-subscriber's fmt layer writes each
/// event in one call): control characters inside the line are escaped, the line's own final
/// newline is kept.
pub struct EscapingWriter<W>(pub W);

impl<W: Write> Write for EscapingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let (body, newline) = match buf.strip_suffix(b"\n") {
            Some(b) => (b, true),
            None => (buf, false),
        };
        let text = String::from_utf8_lossy(body);
        let mut line = escape_control(&text).into_owned();
        if newline {
            line.push('\n');
        }
        self.0.write_all(line.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// A `MakeWriter` wrapping another one's writers in [`EscapingWriter`].
pub struct Escaping<M>(pub M);

impl<'a, M: tracing_subscriber::fmt::MakeWriter<'a>> tracing_subscriber::fmt::MakeWriter<'a>
    for Escaping<M>
{
    type Writer = EscapingWriter<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        EscapingWriter(self.0.make_writer())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_is_kept() {
        assert!(matches!(escape_control("web-1 ünïcode"), Cow::Borrowed(_)));
        assert_eq!(
            escape_control("a\nINFO forged\r\u{1b}[31mred\u{7f}\u{85}"),
            "a\\nINFO forged\\r\\u{1b}[31mred\\u{7f}\\u{85}"
        );
    }

    #[test]
    fn a_log_line_keeps_its_own_newline_only() {
        let mut w = EscapingWriter(Vec::new());
        w.write_all(b"INFO pod=evil\nERROR forged\n")
            .expect("write");
        assert_eq!(
            String::from_utf8(w.0).expect("utf8"),
            "INFO pod=evil\\nERROR forged\n"
        );
    }
}
