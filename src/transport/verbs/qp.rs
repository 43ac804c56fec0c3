//! The RC queue-pair state machine as plain data: which transitions exist and which attributes
//! each one must set. No FFI here; the safe layer maps [`AttrMask`] onto `ibv_qp_attr_mask`
//! bits and refuses transitions this table does not allow, before asking the driver.

#![forbid(unsafe_code)]

use std::fmt;

/// States of a queue pair (`enum ibv_qp_state`, the ones an RC connection goes through).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Freshly created.
    Reset,
    /// Initialised: port, P_Key and access flags set; receives may be posted.
    Init,
    /// Ready to receive: the remote QP number, path and receive PSN are known.
    Rtr,
    /// Ready to send.
    Rts,
    /// Error: outstanding work requests are flushed, nothing touches memory any more.
    Err,
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Err => "ERR",
        })
    }
}

/// Attributes of a `ibv_modify_qp` call, as independent bits (mirrors `ibv_qp_attr_mask`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AttrMask(pub u32);

impl AttrMask {
    /// `IBV_QP_STATE`.
    pub const STATE: AttrMask = AttrMask(1 << 0);
    /// `IBV_QP_ACCESS_FLAGS`.
    pub const ACCESS_FLAGS: AttrMask = AttrMask(1 << 3);
    /// `IBV_QP_PKEY_INDEX`.
    pub const PKEY_INDEX: AttrMask = AttrMask(1 << 4);
    /// `IBV_QP_PORT`.
    pub const PORT: AttrMask = AttrMask(1 << 5);
    /// `IBV_QP_AV` (address vector: LID or GID of the remote port).
    pub const AV: AttrMask = AttrMask(1 << 7);
    /// `IBV_QP_PATH_MTU`.
    pub const PATH_MTU: AttrMask = AttrMask(1 << 8);
    /// `IBV_QP_TIMEOUT` (local ACK timeout).
    pub const TIMEOUT: AttrMask = AttrMask(1 << 9);
    /// `IBV_QP_RETRY_CNT`.
    pub const RETRY_CNT: AttrMask = AttrMask(1 << 10);
    /// `IBV_QP_RNR_RETRY`.
    pub const RNR_RETRY: AttrMask = AttrMask(1 << 11);
    /// `IBV_QP_RQ_PSN`.
    pub const RQ_PSN: AttrMask = AttrMask(1 << 12);
    /// `IBV_QP_MAX_QP_RD_ATOMIC`.
    pub const MAX_QP_RD_ATOMIC: AttrMask = AttrMask(1 << 13);
    /// `IBV_QP_MIN_RNR_TIMER`.
    pub const MIN_RNR_TIMER: AttrMask = AttrMask(1 << 15);
    /// `IBV_QP_SQ_PSN`.
    pub const SQ_PSN: AttrMask = AttrMask(1 << 16);
    /// `IBV_QP_MAX_DEST_RD_ATOMIC`.
    pub const MAX_DEST_RD_ATOMIC: AttrMask = AttrMask(1 << 17);
    /// `IBV_QP_DEST_QPN`.
    pub const DEST_QPN: AttrMask = AttrMask(1 << 20);

    /// Union of two masks.
    pub const fn or(self, o: AttrMask) -> AttrMask {
        AttrMask(self.0 | o.0)
    }

    /// Whether every bit of `o` is set here.
    pub const fn contains(self, o: AttrMask) -> bool {
        self.0 & o.0 == o.0
    }
}

impl std::ops::BitOr for AttrMask {
    type Output = AttrMask;
    fn bitor(self, o: AttrMask) -> AttrMask {
        self.or(o)
    }
}

/// Attributes an RC transition must set (IB spec table 95; `man ibv_modify_qp`), or `None`
/// when the transition does not exist.
pub fn required_attrs(from: QpState, to: QpState) -> Option<AttrMask> {
    use QpState::*;
    let m = match (from, to) {
        (Reset, Init) => {
            AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS
        }
        (Init, Rtr) => {
            AttrMask::STATE
                | AttrMask::AV
                | AttrMask::PATH_MTU
                | AttrMask::DEST_QPN
                | AttrMask::RQ_PSN
                | AttrMask::MAX_DEST_RD_ATOMIC
                | AttrMask::MIN_RNR_TIMER
        }
        (Rtr, Rts) => {
            AttrMask::STATE
                | AttrMask::TIMEOUT
                | AttrMask::RETRY_CNT
                | AttrMask::RNR_RETRY
                | AttrMask::SQ_PSN
                | AttrMask::MAX_QP_RD_ATOMIC
        }
        // Any state may be moved to ERR (stop everything) or back to RESET.
        (_, Err) | (_, Reset) => AttrMask::STATE,
        _ => return None,
    };
    Some(m)
}

/// The transition `from → to` with exactly the attributes `given`: `Err` says why the driver
/// must not be asked (an impossible transition or a missing attribute).
pub fn check_transition(from: QpState, to: QpState, given: AttrMask) -> Result<(), String> {
    let need = required_attrs(from, to)
        .ok_or_else(|| format!("{from} → {to} is not a queue-pair transition"))?;
    if !given.contains(need) {
        return Err(format!(
            "{from} → {to} needs attribute mask {:#x}, got {:#x} (missing {:#x})",
            need.0,
            given.0,
            need.0 & !given.0
        ));
    }
    Ok(())
}

/// The path from RESET to RTS, in order, that connecting a queue pair walks.
pub const CONNECT_PATH: [QpState; 3] = [QpState::Init, QpState::Rtr, QpState::Rts];

#[cfg(test)]
mod tests {
    use super::*;
    use QpState::*;

    #[test]
    fn connect_path_is_reset_init_rtr_rts() {
        let mut s = Reset;
        for next in CONNECT_PATH {
            let m = required_attrs(s, next).expect("each step of the connect path exists");
            assert!(check_transition(s, next, m).is_ok());
            s = next;
        }
        assert_eq!(s, Rts);
    }

    /// The masks of the connect path, written out from `man ibv_modify_qp` (RC, IB spec table
    /// 95) with the bit values of `enum ibv_qp_attr_mask` in rdma-core's verbs.h, independent
    /// of the `AttrMask` constants and of the table in `required_attrs`.
    #[test]
    fn connect_path_requires_exactly_the_attributes_of_ibv_modify_qp() {
        // verbs.h: STATE 1<<0, ACCESS_FLAGS 1<<3, PKEY_INDEX 1<<4, PORT 1<<5.
        const RESET_TO_INIT: u32 = 1 | 1 << 3 | 1 << 4 | 1 << 5;
        // verbs.h: STATE 1<<0, AV 1<<7, PATH_MTU 1<<8, RQ_PSN 1<<12, MIN_RNR_TIMER 1<<15,
        // MAX_DEST_RD_ATOMIC 1<<17, DEST_QPN 1<<20.
        const INIT_TO_RTR: u32 = 1 | 1 << 7 | 1 << 8 | 1 << 12 | 1 << 15 | 1 << 17 | 1 << 20;
        // verbs.h: STATE 1<<0, TIMEOUT 1<<9, RETRY_CNT 1<<10, RNR_RETRY 1<<11,
        // MAX_QP_RD_ATOMIC 1<<13, SQ_PSN 1<<16.
        const RTR_TO_RTS: u32 = 1 | 1 << 9 | 1 << 10 | 1 << 11 | 1 << 13 | 1 << 16;
        assert_eq!(RESET_TO_INIT, 0x39);
        assert_eq!(INIT_TO_RTR, 0x12_9181);
        assert_eq!(RTR_TO_RTS, 0x1_2e01);
        assert_eq!(required_attrs(Reset, Init), Some(AttrMask(RESET_TO_INIT)));
        assert_eq!(required_attrs(Init, Rtr), Some(AttrMask(INIT_TO_RTR)));
        assert_eq!(required_attrs(Rtr, Rts), Some(AttrMask(RTR_TO_RTS)));
        // The same masks by the names of the man page, so that a wrong constant shows too.
        assert_eq!(
            AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS,
            AttrMask(RESET_TO_INIT)
        );
        assert_eq!(
            AttrMask::STATE
                | AttrMask::AV
                | AttrMask::PATH_MTU
                | AttrMask::DEST_QPN
                | AttrMask::RQ_PSN
                | AttrMask::MAX_DEST_RD_ATOMIC
                | AttrMask::MIN_RNR_TIMER,
            AttrMask(INIT_TO_RTR)
        );
        assert_eq!(
            AttrMask::STATE
                | AttrMask::SQ_PSN
                | AttrMask::TIMEOUT
                | AttrMask::RETRY_CNT
                | AttrMask::RNR_RETRY
                | AttrMask::MAX_QP_RD_ATOMIC,
            AttrMask(RTR_TO_RTS)
        );
        // Each step of the connect path is refused without any one of its attributes.
        let mut s = Reset;
        for (next, need) in CONNECT_PATH
            .into_iter()
            .zip([RESET_TO_INIT, INIT_TO_RTR, RTR_TO_RTS])
        {
            assert!(check_transition(s, next, AttrMask(need)).is_ok());
            for bit in (0..32).map(|b| 1u32 << b).filter(|b| need & b != 0) {
                assert!(
                    check_transition(s, next, AttrMask(need & !bit)).is_err(),
                    "{s} → {next} accepted without bit {bit:#x}"
                );
            }
            s = next;
        }
    }

    #[test]
    fn skipping_a_state_is_not_a_transition() {
        assert!(required_attrs(Reset, Rtr).is_none());
        assert!(required_attrs(Init, Rts).is_none());
        assert!(required_attrs(Reset, Rts).is_none());
        assert!(required_attrs(Rts, Rtr).is_none());
        let e = check_transition(Init, Rts, AttrMask::STATE).unwrap_err();
        assert!(e.contains("INIT → RTS"), "{e}");
    }

    #[test]
    fn every_state_can_be_moved_to_error_and_reset() {
        for s in [Reset, Init, Rtr, Rts, Err] {
            assert_eq!(required_attrs(s, Err), Some(AttrMask::STATE));
            assert_eq!(required_attrs(s, Reset), Some(AttrMask::STATE));
        }
    }

    #[test]
    fn a_missing_attribute_is_named() {
        let m = required_attrs(Init, Rtr).unwrap();
        let without_qpn = AttrMask(m.0 & !AttrMask::DEST_QPN.0);
        let e = check_transition(Init, Rtr, without_qpn).unwrap_err();
        assert!(e.contains(&format!("{:#x}", AttrMask::DEST_QPN.0)), "{e}");
        // The RTS step needs the timeout and retry counts that make a dead peer surface.
        let rts = required_attrs(Rtr, Rts).unwrap();
        assert!(rts.contains(AttrMask::TIMEOUT | AttrMask::RETRY_CNT | AttrMask::RNR_RETRY));
    }
}
