//! Unit tests of the encoding (no root): what the batch holds, what the builder emits.
