"""Policies: vision encoders → fusion transformer → waypoint or action-chunk head (see policy.py)."""

from robopolicy.models.encoders import EncoderConfig
from robopolicy.models.language import LanguageConfig
from robopolicy.models.loading import checkpoint_type, load_policy, register_policy_type
from robopolicy.models.policy import Policy, PolicyConfig, PolicyError

__all__ = ["EncoderConfig", "LanguageConfig", "Policy", "PolicyConfig", "PolicyError", "checkpoint_type", "load_policy",
           "register_policy_type"]
