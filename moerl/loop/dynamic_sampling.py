"""Dynamic sampling (DAPO, arXiv 2503.14476): drop finished groups whose rewards are all equal and lease more.

A group whose valid rewards are all the same has zero group-normalised advantage: it adds no gradient, only
tokens to the step (and dilutes a token-mean loss). With `train.dynamic_sampling`, such a group is dropped when
it comes back and one more prompt is leased in its place (the controller gives its lease-gate slot back), so
every batch is made of groups that carry a learning signal.

Bounded: at most `max_extra` groups are dropped per policy version (the step being filled). Past that, the
all-equal groups are kept and trained as without dynamic sampling, and a warning says so: a task the policy has
solved (or cannot solve at all) never spins the loop forever. Counted in `count/groups_filtered` and
`count/groups_filter_over_limit`.
"""

from __future__ import annotations

from typing import Callable

from moerl.loop.types import GroupResult


def zero_advantage(group: GroupResult) -> bool:
    """All of the group's valid rewards are equal (fewer than two valid: nothing to compare, also zero)."""
    valid = [r for r in group.rewards if r is not None]
    return not valid or all(r == valid[0] for r in valid)


class DynamicSampling:
    def __init__(self, max_extra: int, warn: Callable[[str], None] = print, warn_every: int = 100) -> None:
        self.max_extra, self.warn, self.warn_every = max_extra, warn, warn_every
        self._version: int | None = None
        self._left = max_extra
        self._over = False  # the budget of the current version ran out
        self.limit_hits = 0  # versions whose budget ran out

    def keep(self, group: GroupResult, version: int) -> tuple[bool, bool]:
        """(keep the group, it was kept only because this version's budget of extra leases ran out)."""
        if version != self._version:
            self._version, self._left, self._over = version, self.max_extra, False
        if not zero_advantage(group):
            return True, False
        if self._left > 0:
            self._left -= 1
            return False, False
        if not self._over:
            self._over = True
            self.limit_hits += 1
            if self.limit_hits == 1 or self.limit_hits % self.warn_every == 0:
                self.warn(f"warning: dynamic sampling dropped {self.max_extra} all-equal-reward groups at policy "
                          f"version {version} (train.dynamic_sampling_max_extra) and now keeps them; "
                          f"{self.limit_hits} version(s) so far. The task may be solved, or too hard.")
        return True, True
