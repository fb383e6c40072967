"""Verifiers: decide which drafted nodes the target accepts. They see trees and target
distributions only, never models or caches."""

from dynatree_core.verify.greedy import Outcome, verify_greedy

__all__ = ["Outcome", "verify_greedy"]
