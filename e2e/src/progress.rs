//! Step-by-step progress: `[e2e 3/17   41.2 s] what`.
use std::time::Instant;

pub struct Progress {
    started: Instant,
    step: usize,
    steps: usize,
}

impl Progress {
    pub fn new(steps: usize) -> Self {
        Self {
            started: Instant::now(),
            step: 0,
            steps,
        }
    }

    /// A new step.
    pub fn step(&mut self, what: &str) {
        self.step += 1;
        println!(
            "[e2e {:>2}/{} {:>6.1} s] {what}",
            self.step,
            self.steps,
            self.started.elapsed().as_secs_f64()
        );
    }

    /// A result within the current step.
    pub fn note(&self, what: &str) {
        println!(
            "           {:>6.1} s    {what}",
            self.started.elapsed().as_secs_f64()
        );
    }
}
