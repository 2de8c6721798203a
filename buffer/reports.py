"""What the buffer tells the coordinator and the learner about groups it did not train on:
groups dropped unused, validation groups scored, and the validation results themselves.

Drops and scored validation ids are append-only logs for the life of the buffer's session,
read by cursor (:meth:`Reports.since`): a reader moves its cursor only once it has the
reply, so a reply lost on the way is read again, never lost (the coordinator's poll; the
logs are also the inventory a restarted coordinator reconciles with). A few dozen bytes per
group, like the task ids the buffer keeps to recognise duplicates.
"""

from __future__ import annotations

from asyncrl.wire import DroppedTask, Group, ValidationGroup


class Reports:
    """The drop log, the validation log and the validation results per round."""

    def __init__(self) -> None:
        self.drops: list[DroppedTask] = []  # every drop, read by cursor
        self.validated: list[str] = []  # every validation id scored, read by cursor
        self._taken = (0, 0)  # take_dropped/take_validated's own cursors
        # round key -> validation id -> the group's sums: five numbers per group, kept for
        # the session (per group, not per round, so that the learner counts a group once
        # when two buffer sessions both score it, or a reply is read twice)
        self.results: dict[str, dict[str, ValidationGroup]] = {}

    def drop(self, d: DroppedTask) -> None:
        self.drops.append(d)

    def scored(self, group: Group) -> None:
        """A complete validation group: into its round's results (the round: its id up to
        the row, ``val.<lineage>/<round>``), and the log."""
        # Count episodes: the samples of a split episode share its reward.
        rewards = {m.episode_index: m.reward for m in group.metas}
        parts = {m.episode_index: m.reward_parts for m in group.metas}
        failed = {m.episode_index for m in group.metas if m.reward_error}
        versions = [v for m in group.metas for v, n in m.version_spans if n > 0]
        scored = ValidationGroup.of(
            group.data_source,
            list(rewards.values()),
            int(group.response_lens.sum()),
            list(parts.values()),
            (min(versions), max(versions)) if versions else (-1, -1),
            len(failed),
        )
        self.results.setdefault(round_key(group.task_id), {})[group.task_id] = scored
        self.validated.append(group.task_id)

    def results_for(self, rounds: list[str]) -> dict[str, dict[str, ValidationGroup]]:
        """The scored groups of these rounds (every round when none is named)."""
        if not rounds:
            return self.results
        return {key: self.results[key] for key in rounds if key in self.results}

    def since(self, drops_from: int, validated_from: int) -> tuple[list[DroppedTask], list[str]]:
        """Drops and scored validation ids logged since these positions of the two logs."""
        return self.drops[drops_from:], self.validated[validated_from:]

    def take_dropped(self) -> list[DroppedTask]:
        """Drops since the last call (an in-process reader's own cursor)."""
        d, v = self._taken
        self._taken = (len(self.drops), v)
        return self.drops[d:]

    def take_validated(self) -> list[str]:
        """Validation ids scored since the last call (an in-process reader's own cursor)."""
        d, v = self._taken
        self._taken = (d, len(self.validated))
        return self.validated[v:]


def round_key(task_id: str) -> str:
    """A validation group's round: its id without the row (and retry)."""
    return "/".join(task_id.split("/")[:2])
