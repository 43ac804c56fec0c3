//! [`Communicator::flight_record`]: the flight recorder, on demand.

use super::Communicator;
use crate::engine::flight::FlightRecord;

impl Communicator {
    /// This communicator's flight record: its last operations (`DSPARK_FR_ENTRIES`, 2000 by
    /// default), oldest first, then the operations still queued — sequence number,
    /// collective, type, count, operator, root or peer, algorithm, transport, memory path,
    /// state, times, and for a failed call the failure and how far it had got. `None` when
    /// the recorder is off (`DSPARK_FR_ENTRIES=0`). Callable from any thread at any time,
    /// also while an operation runs: it never waits for one.
    ///
    /// [`FlightRecord::to_json`] gives the dump format that `DSPARK_FR_DUMP` writes and
    /// `dspark analyze` reads.
    ///
    /// ```no_run
    /// # fn f(comm: &dspark::Communicator) -> std::io::Result<()> {
    /// if let Some(rec) = comm.flight_record() {
    ///     rec.write_to(std::path::Path::new("/tmp/fr"), "on_demand")?; // /tmp/fr/rank<r>.json
    /// }
    /// # Ok(()) }
    /// ```
    pub fn flight_record(&self) -> Option<FlightRecord> {
        self.shared.flight_record()
    }
}
