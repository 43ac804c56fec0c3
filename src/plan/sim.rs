//! Deterministic simulator for compiled schedules (see the module docs of [`crate::plan`]).
