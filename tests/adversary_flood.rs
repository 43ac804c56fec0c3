#[path = "adversary/flood.rs"]
mod flood;
