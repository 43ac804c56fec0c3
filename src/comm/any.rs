//! Receives from any source: [`Communicator::recv_any`] and [`Communicator::try_recv_any`]
//! (the engine's side is `engine/any.rs`).

use std::time::Duration;

use super::Communicator;
use crate::engine::Call;
use crate::error::{Error, Result};
use crate::plan::Collective;
use crate::types::{DataType, Element};

impl Communicator {
    /// Receives the next message that any peer sends to this rank with
    /// [`Communicator::send`] (or the send half of [`Communicator::send_recv`]) into `buf`,
    /// and returns the peer it came from — MPI's `MPI_Recv` from `MPI_ANY_SOURCE`, torch's
    /// `dist.recv(src=None)`. Messages from one peer are received in the order it sent them;
    /// between peers, the first whose message is there is taken. The message must have
    /// `buf.len()` elements of `T`, as for [`Communicator::recv`].
    ///
    /// Peers that closed their communicator or are gone are passed over; the call fails when
    /// all are, and otherwise at the communicator's deadline ([`Error::Timeout`] naming the
    /// peers it waited for).
    ///
    /// ```no_run
    /// # fn f(comm: &dspark::Communicator) -> dspark::Result<()> {
    /// if comm.rank() == 0 {
    ///     for _ in 1..comm.world_size() {
    ///         let mut msg = [0u32; 4];
    ///         let from = comm.recv_any(&mut msg)?;
    ///         assert_eq!(msg, [from as u32; 4]);
    ///     }
    /// } else {
    ///     comm.send(&[comm.rank() as u32; 4], 0)?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// `InvalidArgument` when `buf` is empty (an empty message carries no frame that could
    /// tell its source) or the world has one rank; `Mismatch` when the first message that
    /// came has a different length or type; as [`Communicator::recv`] otherwise.
    pub fn recv_any<T: Element>(&self, buf: &mut [T]) -> Result<usize> {
        self.recv_any_within(buf, None, None)
            .map(|p| p.unwrap_or(0))
    }

    /// [`Communicator::recv_any`] that waits at most `wait` for a message to start arriving:
    /// `Ok(None)` when none came (nothing was received and the communicator is as it was, so
    /// the call may simply be repeated); `Ok(Some(peer))` once one was received. For a caller
    /// that polls several communicators (torch's point-to-point groups, one per direction).
    ///
    /// # Errors
    /// As [`Communicator::recv_any`]; a `wait` longer than the communicator's deadline ends
    /// in its timeout.
    pub fn try_recv_any<T: Element>(&self, buf: &mut [T], wait: Duration) -> Result<Option<usize>> {
        self.recv_any_within(buf, Some(wait), None)
    }

    /// The body of both, with a deadline for this call (`timeout`, else the communicator's).
    fn recv_any_within<T: Element>(
        &self,
        buf: &mut [T],
        wait: Option<Duration>,
        timeout: Option<Duration>,
    ) -> Result<Option<usize>> {
        self.recv_any_bytes(T::DATA_TYPE, bytemuck::cast_slice_mut(buf), wait, timeout)
    }

    /// [`Communicator::try_recv_any`] (with `wait`) or [`Communicator::recv_any`] (without)
    /// into `buf` holding elements of `dtype`, with a deadline of its own (`timeout`, else
    /// the communicator's): for the Python binding, whose buffers come typed at run time.
    ///
    /// # Errors
    /// As [`Communicator::recv_any`]; `InvalidArgument` when `buf` is not a whole number of
    /// elements.
    #[doc(hidden)]
    pub fn recv_any_bytes(
        &self,
        dtype: DataType,
        buf: &mut [u8],
        wait: Option<Duration>,
        timeout: Option<Duration>,
    ) -> Result<Option<usize>> {
        let esz = dtype.size();
        if buf.is_empty() || !buf.len().is_multiple_of(esz) {
            let why = if buf.is_empty() {
                "an empty message carries no frame that could tell its source: name the source"
                    .to_string()
            } else {
                format!(
                    "{} bytes are no whole number of {dtype} elements",
                    buf.len()
                )
            };
            return Err(Error::invalid(
                Some(self.rank()),
                crate::engine::RECV_ANY,
                why,
            ));
        }
        let call = Call {
            dtype,
            ..Call::new(Collective::SendRecv, None, buf.len() / esz, 0, false)
        };
        self.shared
            .exclusive(timeout, |eng| eng.run_recv_any(&call, buf, wait))
    }
}
