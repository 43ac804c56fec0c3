//! The bootstrap's collectives during init, over the rendezvous's connections: rank 0's
//! broadcast, and the all-gather ([`Bootstrap::all_gather`]), Bruck's over the data
//! connections when the standing partners are linked, else through rank 0. The partial rank
//! table that rank 0 sends with connections on first use is completed with it.

#![forbid(unsafe_code)]

use std::net::{SocketAddr, TcpStream};

use super::{msg, Bootstrap, Ctx, PeerInfo};
use crate::error::{Error, Result};

/// [`Bootstrap::all_gather`] over the connections at distances 2^k (every one present).
fn bruck_all_gather(
    ctx: &Ctx<'_>,
    mesh: &mut [Option<TcpStream>],
    mine: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let n = mesh.len();
    let r = ctx.rank();
    // held[i] is the blob of rank (r + i) mod n.
    let mut held = vec![mine.to_vec()];
    let mut d = 1;
    while d < n {
        let cnt = d.min(n - d);
        let (to, from) = ((r + n - d) % n, (r + d) % n);
        let m = msg::encode_blobs(&held[..cnt]);
        let out = mesh[to]
            .as_ref()
            .ok_or_else(|| ctx.bad(Some(to), "no connection".into()))?
            .try_clone()
            .map_err(|e| ctx.io(Some(to), "duplicating a connection", e))?;
        let src = mesh[from]
            .as_mut()
            .ok_or_else(|| ctx.bad(Some(from), "no connection".into()))?;
        // Send and receive at once: every rank sends before it receives, and a message larger
        // than the socket buffers would otherwise block every rank in its send.
        let got = std::thread::scope(|sc| {
            // `Builder`, not `sc.spawn`: a thread the system refuses (a container's pid limit)
            // is an init error naming the peer, not a panic.
            let sender = std::thread::Builder::new()
                .name("dspark-init-send".into())
                .spawn_scoped(sc, move || {
                    let mut out = out;
                    ctx.send(&mut out, Some(to), m)
                })
                .map_err(|e| ctx.io(Some(to), "starting a sender thread", e))?;
            let got = ctx.recv(src, Some(from), "gathering init data");
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(ctx.bad(Some(to), "the sending thread failed".into())));
            sent.and(got)
        })?;
        let blobs = msg::decode_blobs(&got, cnt).map_err(|w| ctx.bad(Some(from), w))?;
        held.extend(blobs);
        d *= 2;
    }
    let mut all = vec![Vec::new(); n];
    for (i, b) in held.into_iter().enumerate().take(n) {
        all[(r + i) % n] = b;
    }
    Ok(all)
}

impl Bootstrap {
    /// Completes a partial rank table (rank 0 sent only this rank's links): every rank
    /// contributes its own entry, gathered over the data connections (Bruck).
    pub(super) fn gather_table(&mut self, mesh: &mut [Option<TcpStream>]) -> Result<()> {
        let me = &self.peers[self.opts.rank];
        let mine = format!("{}\n{}\n{}", me.addr, me.pid, me.host);
        let all = self.all_gather(mesh, mine.as_bytes())?;
        for (r, b) in all.iter().enumerate() {
            if r == 0 || r == self.opts.rank {
                // Rank 0's address as this rank reached it, and its own, stay.
                continue;
            }
            let text = String::from_utf8_lossy(b);
            let mut parts = text.splitn(3, '\n');
            let addr = parts.next().unwrap_or("");
            let pid = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
            let host = parts.next().unwrap_or("");
            let addr: SocketAddr = addr.parse().map_err(|_| Error::Transport {
                rank: Some(self.opts.rank),
                peer: Some(r),
                op: "bootstrap".into(),
                what: format!("rank {r} gave a bad address {addr:?} for the rank table"),
            })?;
            self.peers[r] = PeerInfo {
                rank: r,
                host: host.to_string(),
                addr,
                pid,
            };
        }
        Ok(())
    }

    /// Rank 0's `mine`, on every rank (rank 0 sends it to each rank once: O(n)).
    ///
    /// # Errors
    /// [`Error::Timeout`] by the configured deadline, [`Error::PeerLost`], [`Error::Io`].
    pub fn broadcast_root(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
        if self.opts.world == 1 {
            return Ok(mine.to_vec());
        }
        let ctx = Ctx::new(&self.opts);
        if self.opts.rank == 0 {
            for (r, slot) in self.star.iter_mut().enumerate().skip(1) {
                let s = slot
                    .as_mut()
                    .ok_or_else(|| ctx.bad(Some(r), "no connection".into()))?;
                ctx.send(s, Some(r), msg::encode_blob(mine))?;
            }
            Ok(mine.to_vec())
        } else {
            let s = self.star[0]
                .as_mut()
                .ok_or_else(|| ctx.bad(Some(0), "no connection".into()))?;
            let m = ctx.recv(s, Some(0), "waiting for rank 0's init data")?;
            msg::decode_blob(&m).map_err(|w| ctx.bad(Some(0), w))
        }
    }

    /// Gathers one blob from every rank, in rank order, over the data connections in `mesh`
    /// (the rendezvous's, as [`rendezvous_with`](super::rendezvous_with) returned them): Bruck's all-gather, in which
    /// at step `k` each rank sends what it holds to the rank `2^k` below it and receives from
    /// the rank `2^k` above, so every rank sends and receives n − 1 blobs in ⌈log2 n⌉ steps and
    /// rank 0 carries no more than any other. Where a needed connection is missing it goes
    /// through rank 0 instead (n² blobs out of rank 0).
    ///
    /// # Errors
    /// [`Error::Timeout`] by the configured deadline, [`Error::PeerLost`], [`Error::Io`].
    pub fn all_gather(
        &mut self,
        mesh: &mut [Option<TcpStream>],
        mine: &[u8],
    ) -> Result<Vec<Vec<u8>>> {
        if self.opts.world == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        let ctx = Ctx::new(&self.opts);
        let (n, r) = (self.opts.world, self.opts.rank);
        let linked = |d: usize| {
            mesh.get((r + n - d) % n).is_some_and(Option::is_some)
                && mesh.get((r + d) % n).is_some_and(Option::is_some)
        };
        let mut d = 1;
        let mut bruck = mesh.len() == n;
        while d < n {
            bruck &= linked(d);
            d *= 2;
        }
        if bruck {
            let res = bruck_all_gather(&ctx, mesh, mine);
            for s in mesh.iter().flatten() {
                let _ = s.set_read_timeout(None);
                let _ = s.set_write_timeout(None);
            }
            return res;
        }
        tracing::debug!(
            rank = r,
            "init exchange through rank 0: a connection at a power-of-two distance is missing"
        );
        if self.opts.rank == 0 {
            let mut all = vec![mine.to_vec()];
            for r in 1..self.opts.world {
                let s = self.star[r]
                    .as_mut()
                    .ok_or_else(|| ctx.bad(Some(r), "no connection".into()))?;
                let m = ctx.recv(s, Some(r), "gathering init data")?;
                all.push(msg::decode_blob(&m).map_err(|w| ctx.bad(Some(r), w))?);
            }
            let m = msg::encode_blobs(&all);
            for (r, slot) in self.star.iter_mut().enumerate().skip(1) {
                let s = slot
                    .as_mut()
                    .ok_or_else(|| ctx.bad(Some(r), "no connection".into()))?;
                ctx.send(s, Some(r), m.clone())?;
            }
            Ok(all)
        } else {
            let s = self.star[0]
                .as_mut()
                .ok_or_else(|| ctx.bad(Some(0), "no connection".into()))?;
            ctx.send(s, Some(0), msg::encode_blob(mine))?;
            let m = ctx.recv(s, Some(0), "waiting for everybody's init data")?;
            msg::decode_blobs(&m, self.opts.world).map_err(|w| ctx.bad(Some(0), w))
        }
    }
}
