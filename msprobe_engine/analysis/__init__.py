"""Offline analysis: anomaly scenes of one dump, comparison of two dumps or two monitor runs."""
from msprobe_engine.analysis.compare import Comparison, RankComparison, Thresholds, compare_dumps
from msprobe_engine.analysis.metrics import TensorMetrics, tensor_metrics
from msprobe_engine.analysis.overflow import Finding, RankAnalysis, analyze, load_ignore_rules
from msprobe_engine.analysis.runs import Divergence, RunComparison, compare_runs

__all__ = ["Comparison", "Divergence", "Finding", "RankAnalysis", "RankComparison", "RunComparison",
           "TensorMetrics", "Thresholds", "analyze", "compare_dumps", "compare_runs", "load_ignore_rules",
           "tensor_metrics"]
