"""Verifiers: decide which drafted nodes the target accepts. They see trees and target
distributions only, never models or caches.

May import: errors, core.
"""

from dynatree_core.verify.greedy import Outcome, verify_greedy

__all__ = ["Outcome", "verify_greedy"]
