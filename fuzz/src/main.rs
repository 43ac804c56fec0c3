//! `dspark-fuzz TARGET`: one of `dspark::internals::fuzzing::TARGETS` under AFL++ (`cargo afl fuzz`).
//! `dspark-fuzz --seeds DIR`: writes a seed corpus of valid inputs, `DIR/TARGET/NNN`.

use std::io::Write;

use dspark::internals::fuzzing::XorShift;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let names: Vec<&str> = dspark::internals::fuzzing::TARGETS
        .iter()
        .map(|(n, _)| *n)
        .collect();
    match args.get(1).map(String::as_str) {
        Some("--seeds") => {
            let dir = std::path::Path::new(args.get(2).map_or("seeds", String::as_str));
            let mut r = XorShift(0x6473_7061_726b);
            for name in &names {
                let d = dir.join(name);
                std::fs::create_dir_all(&d).expect("seed directory");
                for i in 0..16 {
                    let mut f = std::fs::File::create(d.join(format!("{i:03}"))).expect("seed");
                    f.write_all(&dspark::internals::fuzzing::sample(name, &mut r))
                        .expect("seed");
                }
            }
        }
        Some(name) => {
            let Some(target) = dspark::internals::fuzzing::target(name) else {
                eprintln!("unknown target {name:?}; targets: {}", names.join(", "));
                std::process::exit(2);
            };
            afl::fuzz!(|data: &[u8]| {
                target(data);
            });
        }
        None => {
            eprintln!(
                "usage: dspark-fuzz TARGET | dspark-fuzz --seeds DIR\ntargets: {}",
                names.join(", ")
            );
            std::process::exit(2);
        }
    }
}
