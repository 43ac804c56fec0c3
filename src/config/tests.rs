//! Unit tests of `config`: parsing of every variable, its errors and its fallbacks.

use super::*;

#[test]
fn absurd_world_sizes_are_a_config_error_naming_the_variable() {
    for w in [
        "0",
        "1048577",
        "4294967298",
        "1099511627776",
        "18446744073709551615",
    ] {
        let env = [("DSPARK_RANK", "0"), ("DSPARK_WORLD_SIZE", w)];
        let e = Config::from_lookup(|k| {
            env.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
        .unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{w}: {e}");
        assert!(e.to_string().contains("DSPARK_WORLD_SIZE"), "{w}: {e}");
    }
    // The largest accepted, and one above it through validate().
    assert!(Config::new(0, MAX_WORLD_SIZE, "h:1").validate().is_ok());
    assert!(Config::new(0, MAX_WORLD_SIZE + 1, "h:1")
        .validate()
        .is_err());
}
use std::collections::HashMap;

/// A fake environment of `vars`, as [`Config::from_lookup`] reads one.
pub(super) fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

fn err_of(vars: &[(&str, &str)]) -> String {
    Config::from_lookup(env(vars)).unwrap_err().to_string()
}

const TORCHRUN: [(&str, &str); 7] = [
    ("RANK", "1"),
    ("WORLD_SIZE", "2"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29500"),
    ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ("TORCHELASTIC_RUN_ID", "job7"),
    ("TORCHELASTIC_RESTART_COUNT", "2"),
];

#[test]
fn under_torchrun_ranks_meet_through_the_agent_store_keyed_by_run_and_restart() {
    let c = Config::from_lookup(env(&TORCHRUN)).unwrap();
    assert_eq!(c.root_addr, "127.0.0.1:29500");
    assert_eq!(
        c.rendezvous,
        Rendezvous::TorchStore {
            prefix: "dspark/job7/2".into()
        }
    );
}

#[test]
fn dspark_root_addr_or_an_explicit_listen_overrides_the_agent_store() {
    let mut vars = TORCHRUN.to_vec();
    vars.push(("DSPARK_ROOT_ADDR", "10.0.0.1:4000"));
    let c = Config::from_lookup(env(&vars)).unwrap();
    assert_eq!(
        (c.root_addr.as_str(), &c.rendezvous),
        ("10.0.0.1:4000", &Rendezvous::Listen)
    );
    let mut vars = TORCHRUN.to_vec();
    vars.push(("DSPARK_RENDEZVOUS", "listen"));
    assert_eq!(
        Config::from_lookup(env(&vars)).unwrap().rendezvous,
        Rendezvous::Listen
    );
    // Without torchrun's flag, MASTER_ADDR:MASTER_PORT is where rank 0 listens ...
    let plain = &TORCHRUN[..4];
    assert_eq!(
        Config::from_lookup(env(plain)).unwrap().rendezvous,
        Rendezvous::Listen
    );
    // ... unless a torch TCPStore is said to serve it.
    let mut vars = plain.to_vec();
    vars.push(("DSPARK_RENDEZVOUS", "store"));
    assert!(matches!(
        Config::from_lookup(env(&vars)).unwrap().rendezvous,
        Rendezvous::TorchStore { .. }
    ));
}

#[test]
fn an_unknown_rendezvous_is_an_error_naming_the_variable() {
    let mut vars = TORCHRUN.to_vec();
    vars.push(("DSPARK_RENDEZVOUS", "etcd"));
    let e = err_of(&vars);
    assert!(e.contains("DSPARK_RENDEZVOUS") && e.contains("etcd"), "{e}");
}

#[test]
fn dspark_variables_win_over_launcher_variables() {
    let c = Config::from_lookup(env(&[
        ("DSPARK_RANK", "1"),
        ("RANK", "0"),
        ("DSPARK_WORLD_SIZE", "3"),
        ("WORLD_SIZE", "8"),
        ("DSPARK_ROOT_ADDR", "10.0.0.1:29500"),
        ("MASTER_ADDR", "x"),
        ("MASTER_PORT", "1"),
    ]))
    .unwrap();
    assert_eq!(
        (c.rank, c.world_size, c.root_addr.as_str()),
        (1, 3, "10.0.0.1:29500")
    );
}

#[test]
fn torchrun_slurm_and_mpirun_variables_are_understood() {
    let c = Config::from_lookup(env(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node7"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap();
    assert_eq!(
        (c.rank, c.world_size, c.root_addr.as_str()),
        (2, 4, "node7:29500")
    );
    let c = Config::from_lookup(env(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "6"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_JOB_ID", "4242"),
        ("DSPARK_ROOT_ADDR", "n0:1"),
    ]))
    .unwrap();
    assert_eq!((c.rank, c.world_size), (5, 6));
    assert_ne!(c.job_hash(), 0);
    // A batch script's own SLURM_PROCID=0 / SLURM_NTASKS (Slurm 22.05, `sbatch -n 2`: no
    // SLURM_STEP_ID outside srun): refused at once, not rank 0 of 2 waiting its deadline.
    let batch = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_ID", "13"),
        ("DSPARK_ROOT_ADDR", "n0:1"),
    ];
    match Config::from_lookup(env(&batch)) {
        Err(Error::Config { var, what }) => {
            assert_eq!(var, "SLURM_PROCID");
            assert!(what.contains("start the ranks with srun"), "{what}");
        }
        other => panic!("a batch script's variables taken as a rank: {other:?}"),
    }
    // ... but a one-task batch job is one rank, and an older srun's SLURM_STEPID is a step.
    let one = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("DSPARK_ROOT_ADDR", "n0:1"),
    ];
    assert_eq!(Config::from_lookup(env(&one)).unwrap().world_size, 1);
    let older = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEPID", "3"),
        ("DSPARK_ROOT_ADDR", "n0:1"),
    ];
    assert_eq!(Config::from_lookup(env(&older)).unwrap().rank, 1);
    let c = Config::from_lookup(env(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("DSPARK_ROOT_ADDR", "[::1]:7000"),
    ]))
    .unwrap();
    assert_eq!(
        split_host_port(&c.root_addr).unwrap(),
        ("::1".to_string(), 7000)
    );
    let c = Config::from_lookup(env(&[
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("DSPARK_ROOT_ADDR", "h:9"),
    ]))
    .unwrap();
    assert_eq!((c.rank, c.world_size), (1, 2));
}

#[test]
fn bad_configuration_names_the_variable() {
    let e = err_of(&[
        ("DSPARK_RANK", "4"),
        ("DSPARK_WORLD_SIZE", "4"),
        ("DSPARK_ROOT_ADDR", "h:1"),
    ]);
    assert!(e.contains("DSPARK_RANK") && e.contains("rank 4"), "{e}");
    let e = err_of(&[
        ("RANK", "4"),
        ("WORLD_SIZE", "4"),
        ("DSPARK_ROOT_ADDR", "h:1"),
    ]);
    assert!(e.contains("in RANK"), "{e}");
    let e = err_of(&[("DSPARK_RANK", "0"), ("DSPARK_WORLD_SIZE", "0")]);
    assert!(
        e.contains("DSPARK_WORLD_SIZE") && e.contains("at least 1"),
        "{e}"
    );
    let e = err_of(&[("DSPARK_RANK", "x"), ("DSPARK_WORLD_SIZE", "2")]);
    assert!(e.contains("DSPARK_RANK"), "{e}");
    let e = err_of(&[("DSPARK_RANK", "0"), ("DSPARK_WORLD_SIZE", "2")]);
    assert!(e.contains("DSPARK_ROOT_ADDR"), "{e}");
    let e = err_of(&[
        ("DSPARK_RANK", "0"),
        ("DSPARK_WORLD_SIZE", "2"),
        ("DSPARK_ROOT_ADDR", "nohost"),
    ]);
    assert!(e.contains("DSPARK_ROOT_ADDR") && e.contains("port"), "{e}");
    let e = err_of(&[
        ("DSPARK_RANK", "0"),
        ("DSPARK_WORLD_SIZE", "2"),
        ("DSPARK_ROOT_ADDR", "h:99999"),
    ]);
    assert!(e.contains("port"), "{e}");
    let e = err_of(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
    assert!(e.contains("MASTER_PORT"), "{e}");
    let e = err_of(&[
        ("DSPARK_RANK", "0"),
        ("DSPARK_WORLD_SIZE", "1"),
        ("DSPARK_TIMEOUT", "0"),
    ]);
    assert!(e.contains("DSPARK_TIMEOUT"), "{e}");
    let e = err_of(&[
        ("DSPARK_RANK", "0"),
        ("DSPARK_WORLD_SIZE", "1"),
        ("DSPARK_TRANSPORT", "udp"),
    ]);
    assert!(e.contains("DSPARK_TRANSPORT"), "{e}");
    let e = err_of(&[
        ("DSPARK_RANK", "0"),
        ("DSPARK_WORLD_SIZE", "1"),
        ("DSPARK_ALGO", "magic"),
    ]);
    assert!(e.contains("DSPARK_ALGO"), "{e}");
    let e = err_of(&[
        ("DSPARK_RANK", "0"),
        ("DSPARK_WORLD_SIZE", "1"),
        ("DSPARK_DATA_PATH", "nvlink"),
    ]);
    assert!(
        e.contains("DSPARK_DATA_PATH") && e.contains("gpu-direct"),
        "{e}"
    );
    let e = err_of(&[]);
    assert!(e.contains("DSPARK_RANK"), "{e}");
}

const ONE: [(&str, &str); 2] = [("DSPARK_RANK", "0"), ("DSPARK_WORLD_SIZE", "1")];

fn with_one(vars: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    ONE.iter().chain(vars).copied().collect()
}

#[test]
fn every_verbs_and_cache_setting_is_parsed_into_the_config() {
    let c = Config::from_lookup(env(&with_one(&[
        ("DSPARK_IB_SLOTS", "4"),
        ("DSPARK_IB_SLOT_BYTES", "1M"),
        ("DSPARK_IB_TIMEOUT", "18"),
        ("DSPARK_IB_RETRY_CNT", "5"),
        ("DSPARK_IB_RNR_RETRY", "3"),
        ("DSPARK_IB_SL", "3"),
        ("DSPARK_IB_TC", "104"),
        ("DSPARK_IB_SPIN_US", "7"),
        ("DSPARK_IB_ZERO_COPY_MIN", "128K"),
        ("DSPARK_CACHE_DIR", "/cache/here"),
        ("DSPARK_TRACE", "/tmp/run"),
        ("DSPARK_TUNE_FILE", "/tune/model.json"),
    ])))
    .unwrap();
    assert_eq!(c.trace, Some(PathBuf::from("/tmp/run")));
    assert_eq!(c.tune_file, Some(PathBuf::from("/tune/model.json")));
    assert_eq!(
        c.ib,
        IbSettings {
            slots: 4,
            slot_bytes: Some(1 << 20),
            timeout: 18,
            retry_cnt: 5,
            rnr_retry: 3,
            service_level: 3,
            traffic_class: 104,
            spin: Duration::from_micros(7),
            zero_copy_min: 128 << 10,
        }
    );
    assert_eq!(c.cache_dir, Some(PathBuf::from("/cache/here")));
    let c = Config::from_lookup(env(&with_one(&[("HOME", "/home/u")]))).unwrap();
    assert_eq!(c.cache_dir, Some(PathBuf::from("/home/u/.cache/dspark")));
    assert_eq!(
        c.tune_file,
        Some(PathBuf::from("/home/u/.cache/dspark/tune.json"))
    );
    let c = Config::from_lookup(env(&with_one(&[
        ("HOME", "/home/u"),
        ("XDG_CACHE_HOME", "/xdg"),
    ])))
    .unwrap();
    assert_eq!(c.tune_file, Some(PathBuf::from("/xdg/dspark/tune.json")));
    // A hand-built configuration reads nothing: defaults, and no disk cache.
    let c = Config::new(0, 1, "");
    assert_eq!((c.ib.clone(), c.cache_dir), (IbSettings::default(), None));
    assert_eq!((c.trace, c.tune_file), (None, None));
}

#[test]
fn out_of_range_settings_are_refused_naming_the_variable() {
    for (var, v) in [
        ("DSPARK_IB_SLOTS", "1"),
        ("DSPARK_IB_SLOTS", "257"),
        ("DSPARK_IB_TIMEOUT", "0"),
        ("DSPARK_IB_TIMEOUT", "32"),
        ("DSPARK_IB_TIMEOUT", "300"),
        ("DSPARK_IB_RETRY_CNT", "8"),
        ("DSPARK_IB_RNR_RETRY", "7"),
        ("DSPARK_IB_SL", "16"),
        ("DSPARK_IB_TC", "256"),
        ("DSPARK_IB_SPIN_US", "2000000"),
        ("DSPARK_IB_SLOT_BYTES", "4K"),
        ("DSPARK_IB_SLOT_BYTES", "2G"),
        ("DSPARK_IB_ZERO_COPY_MIN", "some"),
        ("DSPARK_CHUNK_BYTES", "0"),
        ("DSPARK_CHUNK_BYTES", "8G"),
        ("DSPARK_SOCKET_BUFFER", "2G"),
        ("DSPARK_SPIN_US", "5000000"),
    ] {
        let e = err_of(&with_one(&[(var, v)]));
        assert!(e.contains(var), "{var}={v}: {e}");
    }
    // The same bounds hold for a configuration built by hand.
    let bad = |f: &dyn Fn(&mut Config), var: &str| {
        let mut c = Config::new(0, 1, "");
        f(&mut c);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains(var), "{var}: {e}");
    };
    bad(&|c| c.segment_bytes = 0, "DSPARK_CHUNK_BYTES");
    bad(&|c| c.segment_bytes = 5 << 30, "DSPARK_CHUNK_BYTES");
    bad(&|c| c.ib.slots = 0, "DSPARK_IB_SLOTS");
    bad(&|c| c.ib.retry_cnt = 9, "DSPARK_IB_RETRY_CNT");
    bad(&|c| c.ib.slot_bytes = Some(100), "DSPARK_IB_SLOT_BYTES");
    bad(&|c| c.spin = Some(Duration::from_secs(5)), "DSPARK_SPIN_US");
    assert!(Config::new(0, 1, "").validate().is_ok());
}

#[test]
fn world_of_one_needs_no_rendezvous_address() {
    let c = Config::from_lookup(env(&[("DSPARK_RANK", "0"), ("DSPARK_WORLD_SIZE", "1")])).unwrap();
    assert_eq!(c.world_size, 1);
}

#[test]
fn sizes_parse_with_binary_suffixes() {
    assert_eq!(parse_size("512K"), Some(512 * 1024));
    assert_eq!(parse_size("1M"), Some(1 << 20));
    assert_eq!(parse_size("2GiB"), Some(2 << 30));
    assert_eq!(parse_size("64"), Some(64));
    assert_eq!(parse_size("lots"), None);
}
