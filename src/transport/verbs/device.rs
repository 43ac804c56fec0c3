//! Device, port and GID selection: which RDMA device and port this rank uses
//! (`DSPARK_IB_DEVICE`, else the first ACTIVE port) and how it is addressed (a LID on
//! InfiniBand, a RoCE v2 GID on Ethernet, `DSPARK_IB_GID_INDEX`); and the dma-buf probe of a
//! device that `dspark doctor` reports.

use dspark_sys as ffi;

use super::ib::{self, Context, Lib, Pd};
use super::options::VerbsOptions;
use super::wire::{LinkLayer, PortAddr};

/// Whether an RDMA device accepts dma-buf registrations (GPUDirect RDMA without
/// nvidia-peermem), as `dspark doctor` reports it: probed with [`ib::Pd::probe_dmabuf`].
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicDmaBuf {
    /// The device (`mlx5_0`).
    pub device: String,
    /// `None` when the probe could not run (the library or the device cannot be opened).
    pub supported: Option<bool>,
    /// What the probe saw, or why it could not run.
    pub detail: String,
}

/// Opens `device`, allocates a protection domain and probes dma-buf registration on it.
pub fn probe_nic_dmabuf(device: &str) -> NicDmaBuf {
    let probe = || -> Result<(Option<bool>, String), String> {
        let lib = ib::load()?;
        let ctx = Context::open(&lib, device).map_err(|e| e.to_string())?;
        // Declared after the context, so dropped before it.
        let pd = Pd::new(&ctx).map_err(|e| e.to_string())?;
        Ok(pd.probe_dmabuf())
    };
    let (supported, detail) = probe().unwrap_or_else(|e| (None, format!("could not probe: {e}")));
    NicDmaBuf {
        device: device.to_string(),
        supported,
        detail,
    }
}

fn is_ipv4_mapped(g: &[u8; 16]) -> bool {
    g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff
}

pub(super) fn gid_string(g: &[u8; 16]) -> String {
    if is_ipv4_mapped(g) {
        return format!("::ffff:{}.{}.{}.{}", g[12], g[13], g[14], g[15]);
    }
    std::net::Ipv6Addr::from(*g).to_string()
}

fn port_state_name(s: u32) -> &'static str {
    use ffi::ibv_port_state as p;
    match s {
        p::IBV_PORT_DOWN => "DOWN",
        p::IBV_PORT_INIT => "INIT",
        p::IBV_PORT_ARMED => "ARMED",
        p::IBV_PORT_ACTIVE => "ACTIVE",
        p::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

/// The device, port and addressing this rank uses.
pub(super) struct Local {
    pub(super) ctx: Context,
    pub(super) port: u8,
    pub(super) addr: PortAddr,
}

pub(super) fn choose_port(lib: &Lib, opts: &VerbsOptions) -> Result<Local, String> {
    let names = match ib::device_names(lib) {
        Ok(names) => names,
        // libibverbs says ENOSYS when the kernel has no RDMA support at all.
        Err(e) if e.err.raw_os_error() == Some(libc::ENOSYS) => {
            return Err("no RDMA devices: this kernel has no RDMA support \
                        (ibv_get_device_list: function not implemented; no InfiniBand/RoCE \
                        driver or ib_uverbs module)"
                .into())
        }
        Err(e) => return Err(e.to_string()),
    };
    if names.is_empty() {
        return Err(
            "no RDMA devices found (ibv_get_device_list returned none: no InfiniBand/RoCE \
                    NIC, or its kernel driver is not loaded)"
                .into(),
        );
    }
    let mut tried = Vec::new();
    let candidates: Vec<(String, Option<u8>)> = match &opts.device {
        Some((name, port)) => {
            if !names.contains(name) {
                return Err(format!(
                    "DSPARK_IB_DEVICE names {name:?}, which does not exist (devices: {})",
                    names.join(", ")
                ));
            }
            vec![(name.clone(), *port)]
        }
        None => names.iter().map(|n| (n.clone(), None)).collect(),
    };
    for (name, want_port) in candidates {
        let ctx = match Context::open(lib, &name) {
            Ok(c) => c,
            Err(e) => {
                tried.push(format!("{name}: {e}"));
                continue;
            }
        };
        let count = ctx.port_count().map_err(|e| format!("{name}: {e}"))?;
        let ports: Vec<u8> = match want_port {
            Some(p) if p > count => {
                return Err(format!(
                    "DSPARK_IB_DEVICE: {name} has {count} port(s), not port {p}"
                ));
            }
            Some(p) => vec![p],
            None => (1..=count).collect(),
        };
        for port in ports {
            let pa = match ctx.query_port(port) {
                Ok(a) => a,
                Err(e) => {
                    tried.push(format!("{name}:{port}: {e}"));
                    continue;
                }
            };
            if pa.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
                tried.push(format!("{name}:{port} is {}", port_state_name(pa.state)));
                continue;
            }
            return address(ctx, port, pa, opts).map_err(|w| format!("{name}:{port}: {w}"));
        }
    }
    Err(format!("no ACTIVE RDMA port ({})", tried.join("; ")))
}

fn address(ctx: Context, port: u8, pa: ib::PortAttr, opts: &VerbsOptions) -> Result<Local, String> {
    let link = if u32::from(pa.link_layer) == ffi::_bindgen_ty_13::IBV_LINK_LAYER_ETHERNET {
        LinkLayer::Ethernet
    } else {
        LinkLayer::InfiniBand
    };
    let mut gid = [0u8; 16];
    let gid_index = match (link, opts.gid_index) {
        (_, Some(gi)) => {
            let e = ctx
                .query_gid(port, gi)
                .map_err(|e| format!("DSPARK_IB_GID_INDEX={gi}: {e}"))?;
            if e.gid == [0; 16] {
                return Err(format!(
                    "DSPARK_IB_GID_INDEX={gi}: that GID table entry is empty"
                ));
            }
            gid = e.gid;
            Some(gi as u8)
        }
        (LinkLayer::InfiniBand, None) => {
            if pa.lid == 0 {
                return Err("InfiniBand port has LID 0 (is a subnet manager running?)".into());
            }
            None
        }
        (LinkLayer::Ethernet, None) => {
            let mut first_v2 = None;
            let mut pick = None;
            for i in 0..pa.gid_tbl_len.clamp(0, 256) as u32 {
                let Ok(e) = ctx.query_gid(port, i) else {
                    continue;
                };
                if e.gid == [0; 16] {
                    continue;
                }
                let v2 = e
                    .gid_type
                    .is_none_or(|t| t == ffi::ibv_gid_type::IBV_GID_TYPE_ROCE_V2);
                if !v2 {
                    continue;
                }
                if is_ipv4_mapped(&e.gid) {
                    pick = Some((i, e.gid));
                    break;
                }
                first_v2.get_or_insert((i, e.gid));
            }
            let (i, g) = pick.or(first_v2).ok_or_else(|| {
                "no RoCE v2 GID on this port (give the interface an IP address, or set \
                 DSPARK_IB_GID_INDEX; `show_gids` lists the table)"
                    .to_string()
            })?;
            gid = g;
            Some(i as u8)
        }
    };
    Ok(Local {
        ctx,
        port,
        addr: PortAddr {
            link,
            lid: pa.lid,
            gid,
            gid_index,
            mtu: pa.active_mtu,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gids_print_as_addresses() {
        let g = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 1];
        assert!(is_ipv4_mapped(&g));
        assert_eq!(gid_string(&g), "::ffff:10.77.0.1");
        let ib = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 2, 0xc9, 3, 0, 1, 2, 3];
        assert!(!is_ipv4_mapped(&ib));
        assert_eq!(gid_string(&ib), "fe80::2:c903:1:203");
    }
}
