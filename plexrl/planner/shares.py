"""Per-user use of the services, for fair-share ordering. Pure: time is passed in.

A user's usage is the service seconds (node run time plus the swaps that preceded it) their jobs have taken,
decayed exponentially with a half-life: an hour-old second counts half (default), so a user who has been
idle a while regains priority, and one user's long history does not lock another out forever.
"""

from __future__ import annotations


class Usage:
    """Decayed service seconds per user. `half_life`: seconds after which a second of use counts half."""

    def __init__(self, half_life: float = 3600.0) -> None:
        if not half_life > 0:
            raise ValueError(f"half_life={half_life}: give a positive number of seconds")
        self.half_life = half_life
        self._v: dict[str, tuple[float, float]] = {}  # user -> (value, as of time)

    def add(self, user: str, seconds: float, now: float) -> None:
        """`user`'s jobs took `seconds` of a service, ending at `now`."""
        self._v[user] = (self.value(user, now) + max(seconds, 0.0), now)

    def value(self, user: str, now: float) -> float:
        """`user`'s decayed service seconds as of `now` (0 for a user never seen).

        >>> u = Usage(half_life=10.0)
        >>> u.add("ann", 4.0, now=0.0)
        >>> u.value("ann", now=10.0)
        2.0
        """
        v, t = self._v.get(user, (0.0, now))
        return v * 0.5 ** (max(now - t, 0.0) / self.half_life)


__all__ = ["Usage"]
