//! A device rank's part in a one-shot all_reduce ([`super::oneshot`]): where the host ranks
//! run a small all_reduce through the transport's shared slots, a rank whose buffer is device
//! memory must too — the slots protocol has no frames, so a device rank that compiled the
//! one-shot *schedule* instead would send frames nobody reads and wait for frames nobody
//! sends (a mismatch, or the deadline). So it copies its device buffer to host memory through
//! its first staging slot (d2h, then a synchronize bounded by the call's deadline), runs the
//! slots protocol on those host bytes exactly as a host rank does, and copies the result back
//! (h2d, synchronized before the call returns). The flight recorder records the call as
//! host-staged, and a trace shows the two copies on the device lane.
//!
//! A failure copying in comes before the call started (no sequence number taken): it fails the
//! call here and tells the peers, as a device that cannot run a call does
//! ([`Engine::fail_before_start`]). A failure copying back comes after every peer completed
//! the call: it poisons this engine and tells them, naming the call.

use std::time::Instant;

use super::drive::internal;
use super::flight::FlightPath;
use super::staged::{DevRange, StagedDevice};
use super::trace::Lane;
use super::{Call, Engine};
use crate::error::{Error, Result};
use crate::plan::Buf;
use crate::types::human_bytes;

impl Engine {
    /// Runs `call` — which [`Engine::runs_one_shot`] — on the device buffer of `dev`: host
    /// copy, the slots protocol, copy back (the module docs). `direct`: `dev` is a direct
    /// (GPUDirect) device, which has no host slots to stage through.
    pub(super) fn run_staged_one_shot(
        &mut self,
        call: &Call,
        dev: &mut dyn StagedDevice,
        direct: bool,
    ) -> Result<()> {
        if direct {
            // No transport has both shared slots and a direct region today; should one, the
            // rank fails the call here, telling its peers, rather than speak frames to slots.
            let e = Error::invalid(
                Some(self.rank),
                call.coll.name(),
                "a direct (GPUDirect) device cannot take part in a one-shot all_reduce \
                 through shared slots: it has no host slots to stage through",
            );
            return Err(self.fail_before_start(call, e));
        }
        let mut host = std::mem::take(&mut self.scratch.staged.one_shot_host);
        let result = self.staged_one_shot_in(call, dev, &mut host);
        self.scratch.staged.one_shot_host = host;
        result
    }

    fn staged_one_shot_in(
        &mut self,
        call: &Call,
        dev: &mut dyn StagedDevice,
        host: &mut Vec<u8>,
    ) -> Result<()> {
        let start = Instant::now();
        let timeout = self.call_timeout.unwrap_or(self.opts.timeout);
        let deadline = crate::time::deadline(start, timeout);
        // A buffer shorter than the call is copied as far as it goes: the one-shot body then
        // fails the call with the host path's own error.
        let bytes = call
            .count
            .saturating_mul(call.dtype.size())
            .min(dev.buffer_bytes().1);
        host.clear();
        host.resize(bytes, 0);
        if let Err(e) = copy_out(dev, host, deadline) {
            let e = self.named_device_error(e, start, "copying the input to the host");
            return Err(self.fail_before_start(call, e));
        }
        self.trace_copy("d2h", start, bytes);
        self.run_one_shot_as(call, FlightPath::HostStaged, &[], host)?;
        let back = Instant::now();
        if let Err(e) = copy_in(dev, host, deadline) {
            let e = self
                .named_device_error(e, start, "copying the result to the device")
                .in_op(&format!("{} #{}", call.coll.name(), self.seq))
                .at_rank(self.rank);
            self.fail(e.clone());
            return Err(e);
        }
        self.trace_copy("h2d", back, bytes);
        Ok(())
    }

    /// A device timeout named after this rank and what it waited for (the device layer does
    /// not know its rank); other errors as they are.
    fn named_device_error(&self, e: Error, start: Instant, what: &str) -> Error {
        match e {
            Error::Timeout { op, .. } => Error::Timeout {
                rank: self.rank,
                peer: None,
                op,
                waited: start.elapsed(),
                detail: format!("waiting for the device: {what} of a one-shot all_reduce"),
            },
            e => e,
        }
    }

    /// A device-lane span for one of the copies, while tracing.
    fn trace_copy(&mut self, what: &'static str, t0: Instant, bytes: usize) {
        if let Some(t) = self.trace.as_mut() {
            let name = format!("{what} {}", human_bytes(bytes as u64, false));
            let args = [("bytes", bytes.to_string()), ("one-shot", "true".into())];
            t.span(Lane::Device, what, &name, t0, Instant::now(), &args);
        }
    }
}

/// Bytes per copy through staging slot 0 (the calls are small: one copy unless the slots are
/// smaller than the call, as in the tests' tiny pools).
fn part_bytes(dev: &dyn StagedDevice) -> Result<usize> {
    match dev.slot_bytes() {
        0 => Err(internal("staging device has slots of 0 bytes")),
        n => Ok(n),
    }
}

/// Device `Dst[..host.len()]` → `host`, through slot 0, waiting for each copy.
fn copy_out(dev: &mut dyn StagedDevice, host: &mut [u8], deadline: Instant) -> Result<()> {
    let part = part_bytes(dev)?;
    for (k, chunk) in host.chunks_mut(part).enumerate() {
        let at = k * part;
        let src = DevRange {
            buf: Buf::Dst,
            bytes: at..at + chunk.len(),
        };
        dev.d2h(&src, 0)?;
        dev.synchronize(deadline)?;
        let slot = dev
            .slot(0)
            .get(..chunk.len())
            .ok_or_else(|| internal("the staging slot is not readable after its copy-out"))?;
        chunk.copy_from_slice(slot);
    }
    Ok(())
}

/// `host` → device `Dst[..host.len()]`, through slot 0, waiting for each copy.
fn copy_in(dev: &mut dyn StagedDevice, host: &[u8], deadline: Instant) -> Result<()> {
    let part = part_bytes(dev)?;
    for (k, chunk) in host.chunks(part).enumerate() {
        let at = k * part;
        dev.slot_mut(0)
            .get_mut(..chunk.len())
            .ok_or_else(|| internal("the staging slot is not writable before its copy-in"))?
            .copy_from_slice(chunk);
        dev.h2d(0, at..at + chunk.len())?;
        dev.synchronize(deadline)?;
    }
    Ok(())
}
