//! Blocking basics: allreduce, all_gather, broadcast and barrier.
//!
//! ```text
//! cargo run --release --example basics                 # 2 local ranks
//! DSPARK_EXAMPLE_RANKS=4 cargo run --release --example basics
//! torchrun --standalone --nproc-per-node 2 --no-python target/release/examples/basics
//! ```

#[path = "common/local.rs"]
mod local;

use dspark::{Communicator, ReduceOp};

fn main() -> dspark::Result<()> {
    if !local::as_rank() {
        return Ok(());
    }
    let comm = Communicator::from_env()?;
    let (rank, world) = (comm.rank(), comm.world_size());

    // Every rank contributes rank + 1; the sum is world (world + 1) / 2 everywhere.
    let mut grads = vec![(rank + 1) as f32; 1 << 20];
    comm.all_reduce(&mut grads, ReduceOp::Sum)?;
    assert_eq!(grads[0], (world * (world + 1) / 2) as f32);

    // Rank order.
    let mine = [rank as u64; 4];
    let mut all = vec![0u64; 4 * world];
    comm.all_gather(&mine, &mut all)?;

    // Rank 0's parameters everywhere.
    let mut params = vec![dspark::bf16::from_f32(rank as f32); 1 << 16];
    comm.broadcast(&mut params, 0)?;
    comm.barrier()?;
    if rank == 0 {
        println!(
            "{world} ranks over {}: allreduce sum {} (want {}), all_gather {:?}, broadcast {}",
            comm.info().transport,
            grads[0],
            world * (world + 1) / 2,
            all.chunks(4).map(|c| c[0]).collect::<Vec<_>>(),
            params[0]
        );
    }
    Ok(())
}
