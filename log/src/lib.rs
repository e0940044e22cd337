//! Log and terminal hygiene. Much of what calix logs or prints comes from outside: pod names
//! and namespaces from CNI_ARGS or the datastore, interface names, error texts of other tools.
//! A newline in a pod name must not forge a log line, and an escape sequence must not drive
//! the operator's terminal. Every log line goes through [`EscapingWriter`], and calixctl
//! prints every table cell through [`escape_control`].
//!
//! And one way to print an error with its causes on one line, [`error_chain`], for every log
//! line and every message that carries an error outside of a binary's `anyhow` edge.
use std::borrow::Cow;
use std::error::Error;
use std::fmt;
use std::io::{self, Write};

/// `e` and its causes on one line, outermost first: `outer: inner: innermost`.
///
/// A cause whose text the line already holds is left out: many errors write their source into
/// their own message (`#[error("cannot run {cmd}: {source}")]`), and the line says it once.
/// An empty message is left out too. Everything else is kept, so nothing of anyhow's `{:#}`
/// is lost and nothing is said twice.
pub fn error_chain(e: &dyn Error) -> String {
    let mut line = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !text.is_empty() && !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

/// [`error_chain`] as a `Display`, for a log field: `error = %ErrorChain(&e)`.
pub struct ErrorChain<'a>(pub &'a dyn Error);

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&error_chain(self.0))
    }
}

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

    /// An error with a message and maybe a cause.
    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);

    impl fmt::Display for E {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl Error for E {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|e| e as &(dyn Error + 'static))
        }
    }

    fn chain(messages: &[&'static str]) -> E {
        let mut e = None;
        for m in messages.iter().rev() {
            e = Some(E(m, e.map(Box::new)));
        }
        e.expect("at least one message")
    }

    #[test]
    fn an_error_chain_is_outer_to_innermost_on_one_line() {
        assert_eq!(error_chain(&chain(&["alone"])), "alone");
        assert_eq!(
            error_chain(&chain(&[
                "cannot add route",
                "netlink",
                "File exists (os error 17)"
            ])),
            "cannot add route: netlink: File exists (os error 17)"
        );
        assert_eq!(
            ErrorChain(&chain(&["outer", "inner"])).to_string(),
            "outer: inner"
        );
    }

    #[test]
    fn a_cause_the_line_already_says_is_not_repeated() {
        // thiserror's `#[error("cannot run {cmd}: {source}")]`: the message holds its source.
        assert_eq!(
            error_chain(&chain(&[
                "cannot run ip: No such file or directory (os error 2)",
                "No such file or directory (os error 2)",
            ])),
            "cannot run ip: No such file or directory (os error 2)"
        );
        // Below a repeated cause, new causes are still said.
        assert_eq!(error_chain(&chain(&["a: b", "b", "c"])), "a: b: c");
        // Empty messages add no ": ".
        assert_eq!(error_chain(&chain(&["a", "", "c"])), "a: c");
        assert_eq!(error_chain(&chain(&["", "b"])), "b");
        // A real one: io::Error inside a wrapper that does not print it.
        let io = io::Error::new(io::ErrorKind::NotFound, chain(&["gone"]));
        assert_eq!(error_chain(&io), "gone");
    }

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
