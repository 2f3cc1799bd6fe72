"""PLOT (HMI §3.2.1, §5.1; SkipBERT): precomputed lower-layer states of trigrams, a root table plus
domain overlays, looked up and aggregated per token instead of running the teacher's lower K layers."""

from academus.shared.models.plot.store import InvalidTokens, Lookup, LookupCounts, PlotStore, UnknownDomain
from academus.shared.models.plot.table import PlotError, PlotManifest, TableError, load_version

__all__ = ["InvalidTokens", "Lookup", "LookupCounts", "PlotError", "PlotManifest", "PlotStore", "TableError",
           "UnknownDomain", "load_version"]
