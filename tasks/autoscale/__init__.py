"""The autoscaler: instance counts that follow each version's load (:mod:`tasks.autoscale.loop`),
on the signals of :mod:`tasks.autoscale.signals` and the policy of :mod:`modelops.scaling`."""

from tasks.autoscale.loop import Autoscaler

__all__ = ["Autoscaler"]
