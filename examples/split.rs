//! Sub-communicators: split the world into even and odd ranks (as tensor- and
//! data-parallel groups are built), run a collective in both groups at once, and keep using
//! the parent.
//!
//! ```text
//! DSPARK_EXAMPLE_RANKS=5 cargo run --release --example split
//! ```

#[path = "common/local.rs"]
mod local;

use dspark::{Communicator, ReduceOp};

fn main() -> dspark::Result<()> {
    if !local::as_rank() {
        return Ok(());
    }
    let world = Communicator::from_env()?;
    let rank = world.rank();
    // Same colour, same group; the key orders ranks inside it (here: by old rank).
    let colour = (rank % 2) as i32;
    let group = world
        .split(Some(colour), rank as i32)?
        .expect("every rank chose a colour");
    let mut x = vec![rank as i64; 8];
    group.all_reduce(&mut x, ReduceOp::Sum)?;
    println!(
        "world rank {rank}: {} group rank {} of {}, sum of the group's world ranks = {}",
        if colour == 0 { "even" } else { "odd" },
        group.rank(),
        group.world_size(),
        x[0]
    );
    // The parent is unaffected.
    world.barrier()?;
    Ok(())
}
