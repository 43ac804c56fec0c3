//! The doctor's fixes: for every blocker it can name, the one-line remedy printed under it
//! (`-> ...`) and listed in the JSON's `fixes`. One table here, so the same blocker gets the
//! same advice in the fast paths, the GPU/NIC pairs and the requirements.

pub(super) const FIX_RDMA_CORE: &str =
    "install rdma-core (Debian/Ubuntu: apt-get install rdma-core ibverbs-providers; \
     RHEL/Rocky: dnf install rdma-core libibverbs)";
pub(super) const FIX_NO_NIC: &str =
    "load the NIC's RDMA driver (mlx5_ib for NVIDIA/Mellanox; check `rdma link`), \
     or for a functional test create Soft-RoCE: rdma link add rxe0 type rxe netdev <eth>";
pub(super) const FIX_PORT: &str = "check the link (`ibstat`, cable, switch port); InfiniBand also needs a subnet manager (opensm)";
pub(super) const FIX_LIBCUDA: &str =
    "install the NVIDIA driver (check `nvidia-smi`); in a container run with --gpus all \
     (NVIDIA container toolkit)";
pub(super) const FIX_NO_DEVICE: &str = "check `nvidia-smi` and CUDA_VISIBLE_DEVICES";
pub(super) const FIX_PEERMEM: &str =
    "modprobe nvidia-peermem (ships with the NVIDIA driver; persist it in /etc/modules-load.d); \
     it must exist as /sys/module/nvidia_peermem/version";
pub(super) const FIX_GPU_RDMA: &str =
    "GPUDirect RDMA is a data-center GPU's feature (GeForce-class GPUs report it off): run on \
     such a GPU, or use dma-buf where the GPU supports it";
pub(super) const FIX_DMABUF: &str =
    "dma-buf needs the NVIDIA open kernel modules (driver >= 515) on Turing or newer, \
     Linux >= 5.12 and rdma-core >= 34";
pub(super) const FIX_NIC_DMABUF: &str =
    "dma-buf registration needs a NIC driver that implements it (mlx5 on Linux >= 5.12 with \
     rdma-core >= 34); software RDMA (rxe, siw) never does: use nvidia-peermem there";
pub(super) const FIX_DISTANCE: &str =
    "use a GPU that shares a PCIe switch with the NIC (`nvidia-smi topo -m`), or the closest \
     NIC (DSPARK_IB_DEVICE)";
pub(super) const FIX_NVRTC: &str =
    "install NVRTC: the CUDA toolkit, or `pip install nvidia-cuda-nvrtc-cu12` \
     (tests/gpu/install_nvrtc.sh) and put its lib directory on LD_LIBRARY_PATH";
pub(super) const FIX_MEMLOCK: &str = "`ulimit -l unlimited` before starting; persistent: `* - memlock unlimited` in \
     /etc/security/limits.conf; systemd services: LimitMEMLOCK=infinity; containers: --ulimit memlock=-1";

/// The fixes for the blockers named in a capability's reason, in order, without repeats.
pub(super) fn fixes_for_capability(why: &str) -> Vec<String> {
    let table: [(&str, &str); 7] = [
        ("CUDA driver", FIX_LIBCUDA),
        ("libibverbs", FIX_RDMA_CORE),
        ("ACTIVE", FIX_PORT),
        ("apart (", FIX_DISTANCE),
        ("refuse dma-buf registration", FIX_NIC_DMABUF),
        ("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED", FIX_DMABUF),
        ("nvidia-peermem is not loaded", FIX_PEERMEM),
    ];
    let mut out: Vec<String> = Vec::new();
    for (needle, fix) in table {
        if why.contains(needle) && !out.iter().any(|f| f == fix) {
            out.push(fix.to_string());
        }
    }
    out
}
