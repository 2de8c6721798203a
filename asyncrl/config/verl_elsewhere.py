"""veRL keys from other veRL versions than the one :mod:`asyncrl.config.verl_table` follows,
with the fix each one needs. Unknown to the table, such a key was refused with difflib's
nearest name, which for these pointed at a key of another meaning (``multi_turn.max_turns``
at ``max_user_turns``, where it is the cap on the assistant's turns; ``tis_imp_ratio_cap``
at ``clip_ratio_c``). Keyed by the key as read here (:func:`~asyncrl.config.verl_key.
our_key` of veRL's spelling); the fixes name veRL's spelling, as the user typed it.
"""

from __future__ import annotations

from asyncrl.config.verl_key import our_key

_ROLLOUT = "actor_rollout_ref.rollout"
_ACTOR = "actor_rollout_ref.actor"

_FIXES = {
    f"{_ROLLOUT}.multi_turn.max_turns": (
        f"older veRL's cap on the assistant's turns: use {_ROLLOUT}.multi_turn.max_assistant_turns"
    ),
    f"{_ACTOR}.tis_imp_ratio_cap": (
        "newer veRL's truncated importance sampling: here algorithm.importance.mode=tis "
        "with algorithm.importance.cap=<the cap> (algorithm.importance.level=token)"
    ),
    f"{_ACTOR}.optim.clip_grad": f"newer veRL's name of {_ACTOR}.grad_clip: use that key",
    f"{_ROLLOUT}.quantization": "quantized rollout is not built here: remove the key",
    f"{_ROLLOUT}.quantization_config_file": "quantized rollout is not built here: remove the key",
    f"{_ACTOR}.use_gpg_loss": "GPG's loss is not built here: remove the key",
    f"{_ACTOR}.loss_scale_factor": (
        "newer veRL's constant divisor of seq-mean-token-sum-norm is not built here (the "
        "divisor is data.max_response_length, as veRL's without it): remove the key"
    ),
    **{
        f"data.{split}_max_samples": (
            f"newer veRL's cap on the {split} rows read is not read here: remove the key (at "
            "its default, -1, veRL reads every row, as here), or write the rows to use to a "
            f"smaller parquet file for data.{split}_files"
        )
        for split in ("train", "val")
    },
}
ELSEWHERE = {our_key(k): fix for k, fix in _FIXES.items()}


def elsewhere_fix(key: str) -> str | None:
    """The fix for ``key`` (as read here) when it is a veRL key of another version, else
    None (the caller names the nearest key)."""
    return ELSEWHERE.get(key)
