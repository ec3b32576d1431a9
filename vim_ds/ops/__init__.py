"""Selective-scan ops: the public op, the fused mixer branch, the reference, and the backends behind them."""
from .selective_scan import selective_scan_fn, validate
from .scan_state import selective_scan_with_state
from .selective_scan_ref import selective_scan_ref
from .ssm_branch import ssm_branch_fn

__all__ = ["selective_scan_fn", "selective_scan_ref", "selective_scan_with_state", "ssm_branch_fn", "validate"]
