//! The engine's cache of compiled programs. A training loop cycles through a few collectives
//! on a few bucket sizes, so each (request, segment size) is scheduled and compiled once, with
//! the extent of the buffers it touches, and kept; the least recently used entry is replaced.

use std::sync::Arc;

use super::Engine;
use crate::error::{Error, Result};
use crate::plan::{self, Algorithm, Collective, Op, Program, Request};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ProgramKey {
    req: ReqKey,
    seg_elems: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ReqKey {
    coll: Collective,
    algo: Algorithm,
    count: usize,
    root: usize,
    is_send: bool,
    finalize: bool,
    per_host: usize,
}

/// Compiled programs kept (least recently used ones are replaced): a training loop cycles
/// through a few bucket sizes per collective.
const CACHE_SLOTS: usize = 64;

/// A compiled program and the number of elements of `Src` and `Dst` it touches.
#[derive(Clone, Debug)]
pub(super) struct Compiled {
    pub(super) prog: Arc<Program>,
    pub(super) extent: [usize; 2],
}

/// One cached program, with the clock of its last use.
#[derive(Debug)]
pub(super) struct CacheEntry {
    key: ProgramKey,
    compiled: Compiled,
    used: u64,
}

impl Engine {
    /// The compiled program of `req` (from the cache when it was compiled before), and how
    /// many elements of `Src` and `Dst` it touches.
    pub(super) fn program(&mut self, req: &Request, esz: usize) -> Result<Compiled> {
        let seg = super::call_segment(
            self.opts.segment_bytes,
            self.world,
            self.transport.kind(),
            req.coll,
            req.count.saturating_mul(esz),
        );
        let seg_elems = (seg / esz).max(1);
        let key = ProgramKey {
            req: ReqKey {
                coll: req.coll,
                algo: req.algo,
                count: req.count,
                root: req.root,
                is_send: req.is_send,
                finalize: req.finalize,
                per_host: req.per_host,
            },
            seg_elems,
        };
        self.clock += 1;
        let now = self.clock;
        if let Some(e) = self.cache.iter_mut().find(|e| e.key == key) {
            e.used = now;
            return Ok(e.compiled.clone());
        }
        let sched = plan::schedule(req).ok_or_else(|| {
            Error::invalid(
                Some(self.rank),
                req.coll.name(),
                format!("algorithm {} does not implement {}", req.algo, req.coll),
            )
        })?;
        let prog = plan::compile(&sched, seg_elems);
        let mut extent = [0usize; 2];
        for st in &prog.steps {
            let locs = match st.op {
                Op::Send { src, .. } => [Some(src), None],
                Op::Recv { dst, acc, .. } => [Some(dst), acc],
                Op::Copy { src, dst } => [Some(src), Some(dst)],
                Op::Finalize { loc } => [Some(loc), None],
            };
            for l in locs.into_iter().flatten() {
                let b = l.buf as usize;
                extent[b] = extent[b].max(l.start + l.len);
            }
        }
        let compiled = Compiled {
            prog: Arc::new(prog),
            extent,
        };
        let entry = CacheEntry {
            key,
            compiled: compiled.clone(),
            used: now,
        };
        if self.cache.len() < CACHE_SLOTS {
            self.cache.push(entry);
        } else if let Some(lru) = self.cache.iter_mut().min_by_key(|e| e.used) {
            *lru = entry;
        }
        Ok(compiled)
    }
}
