"""Adaptive compression: a controller actor (:mod:`.controller`), its decision rules
(:mod:`.policy`) and the cost model of a step they fit (:mod:`.model`)."""

from .controller import AdaptiveController, Decision, PrometheusSource, SourceError, controller_name, start_controller
from .model import LinkFit, Prediction, StepModel, StepSample, combine_ranks, fit_link
from .policy import CostModelPolicy, Policy, PolicyInputs, PressurePolicy, make_policy

__all__ = ["AdaptiveController", "CostModelPolicy", "Decision", "LinkFit", "Policy", "PolicyInputs", "Prediction",
           "PressurePolicy", "PrometheusSource", "SourceError", "StepModel", "StepSample", "combine_ranks",
           "controller_name", "fit_link", "make_policy", "start_controller"]
