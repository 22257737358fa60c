"""The parallel layout (`strategies.layout`), where the job manager's modules import it from.

It lives in `strategies` because the planner there ranks layouts without the
job manager; `elastic` uses it for placement, rank coordinates and resizing.
"""

from strategies.layout import AXES, Layout, LayoutError

__all__ = ["AXES", "Layout", "LayoutError"]
