"""How long each replica takes to give a first token, learned from what it gave.

The time to first token of a streamed request is modelled per replica as a line,

    ttft = intercept + slope · work,

where `work` is the prompt tokens the replica must compute for it (its prompt less what it had
cached) plus the work ahead of it there when it was sent (the prompt tokens other requests sent
there have not had computed yet). `slope` is the replica's seconds per prefilled token, which is
what sets a slower GPU, a smaller batch or a throttled host apart; `intercept` is what a request
costs with nothing to compute (the network, the engine's scheduling step).

Each replica's line is a weighted least-squares fit over its observations, each weighing half as
much every `half_life` seconds, so that a replica that slows down or recovers is followed within
a few half-lives. Until a replica has observations of its own, and while it has few, its fit
leans on the fleet's (every replica's observations together, remembered ten times longer): as
if one more observation lay on the fleet's line. A replica none of whose recent requests was
observed predicts the fleet's line, or its own past where that was faster: nothing says it is
slower, so it gets requests again and is measured again. Forgetting only ever hopes: the
fleet's line is made of the replicas this gateway sent to, and when other gateways' choices
leave it sending mostly to a slow one, a fast replica forgotten into that line would never be
tried again.

Cost: O(1) an observation (the decayed sums of the replica and of the fleet) and O(1) a
prediction (a 2×2 solve, cached until the next observation or an eighth of a half-life).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefix_gateway.clock import Clock

_RIDGE = 1.0
"""How many observations the fleet's line is worth in a replica's fit."""

_FLEET_MEMORY = 10.0
"""How many times longer than a replica's fit the fleet's remembers: it is the prior a replica
leans on, which should outlast a lull in traffic, not follow one replica's slowdown."""


@dataclass(frozen=True, slots=True)
class Line:
    intercept: float
    """Seconds to a first token with no work to compute."""
    slope: float
    """Seconds per token of work."""

    def seconds(self, work_tokens: float) -> float:
        return self.intercept + self.slope * work_tokens


class _Sums:
    """Decayed weighted sums of (work, seconds) pairs: their weight, Σx, Σy, Σx², Σxy, Σy²."""

    __slots__ = ("at", "weight", "xs", "xx", "xy", "ys", "yy")

    def __init__(self) -> None:
        self.at = 0.0
        self.weight = self.xs = self.ys = self.xx = self.xy = self.yy = 0.0

    def add(self, now: float, half_life: float, work: float, seconds: float) -> None:
        keep = self._kept(now, half_life)
        self.weight = self.weight * keep + 1.0
        self.xs = self.xs * keep + work
        self.ys = self.ys * keep + seconds
        self.xx = self.xx * keep + work * work
        self.xy = self.xy * keep + work * seconds
        self.yy = self.yy * keep + seconds * seconds
        self.at = now

    def weight_at(self, now: float, half_life: float) -> float:
        return self.weight * self._kept(now, half_life)

    def spread(self, line: Line) -> float:
        """How uncertain `line` is as a mean of these observations: their standard deviation
        about it over the square root of their weight, in seconds."""
        a, b = line.intercept, line.slope
        squares = (
            self.yy
            - 2 * a * self.ys
            - 2 * b * self.xy
            + a * a * self.weight
            + 2 * a * b * self.xs
            + b * b * self.xx
        )
        weight = max(self.weight, 1.0)
        return math.sqrt(max(squares, 0.0) / max(self.weight - 2.0, 1.0) / weight)

    def _kept(self, now: float, half_life: float) -> float:
        return 0.5 ** ((now - self.at) / half_life) if now > self.at else 1.0

    def line(
        self, prior: Line | None = None, ridge: float = 0.0, mean: float = 0.0, var: float = 0.0
    ) -> Line | None:
        """The least-squares line, leaning on `prior` as if `ridge` more observations lay on
        it, their work of mean `mean` and variance `var` (the fleet's); None when the sums
        cannot tell a line (and no prior is given)."""
        weight, xs, ys, xx, xy = self.weight, self.xs, self.ys, self.xx, self.xy
        if prior is not None:
            square = mean * mean + var
            weight += ridge
            xs += ridge * mean
            xx += ridge * square
            ys += ridge * (prior.intercept + prior.slope * mean)
            xy += ridge * (prior.intercept * mean + prior.slope * square)
        if weight <= 0:
            return None
        det = weight * xx - xs * xs
        if det <= 1e-12 * max(weight * xx, 1e-300):
            # Every observation at one amount of work: through their mean, at the prior's
            # slope where it fits, else through the origin.
            mean_work, mean_seconds = xs / weight, ys / weight
            slope = prior.slope if prior is not None else 0.0
            if mean_seconds - slope * mean_work < 0.0 or (prior is None and mean_work > 0):
                slope = mean_seconds / mean_work
            return Line(mean_seconds - slope * mean_work, slope)
        slope = (weight * xy - xs * ys) / det
        intercept = (ys - slope * xs) / weight
        if slope < 0.0:
            # Noise, not a replica that gets faster with work: the mean time, flat.
            slope, intercept = 0.0, ys / weight
        return Line(max(intercept, 0.0), slope)


class _Fit:
    __slots__ = ("line", "lined_at", "spread", "sums")

    def __init__(self) -> None:
        self.sums = _Sums()
        self.line: Line | None = None
        self.spread = 0.0
        """How uncertain its line is (the standard error of its mean time, seconds)."""
        self.lined_at = -math.inf


class FirstTokenModel:
    """Every replica's line, and the fleet's, on `clock`. One per gateway process: each learns
    from the requests it sees (docs/routing.md says why the fits are not shared)."""

    def __init__(
        self, half_life: float, clock: Clock, margin: float = 1.5, min_weight: float = 3.0
    ) -> None:
        """`margin`: how many times the fleet's slope a replica's must be to count as slow."""
        self._half_life = half_life
        self._clock = clock
        self._margin = margin
        self._min_weight = min_weight
        self._fleet = _Fit()
        self._fits: dict[str, _Fit] = {}
        self._stale = half_life / 8
        self._slow: dict[str, float] = {}
        self._slow_at = -math.inf

    @property
    def learned(self) -> bool:
        """Whether the fleet has enough recent observations to predict anything."""
        return self._fleet_line(self._clock()) is not None

    def observe(self, backend: str, work_tokens: float, seconds: float) -> None:
        """`backend` gave a first token `seconds` after it was sent a request with
        `work_tokens` to compute, its own and those ahead of it."""
        now = self._clock()
        fit = self._fits.get(backend)
        if fit is None:
            fit = self._fits[backend] = _Fit()
        fit.sums.add(now, self._half_life, work_tokens, seconds)
        fit.lined_at = -math.inf
        self._fleet.sums.add(now, self._half_life * _FLEET_MEMORY, work_tokens, seconds)
        self._fleet.lined_at = -math.inf

    def line(self, backend: str) -> Line | None:
        """`backend`'s line now: its own fit leaning on the fleet's, the fleet's where it has
        no recent observations, None while the fleet has too few."""
        now = self._clock()
        fleet = self._fleet_line(now)
        if fleet is None:
            return None
        fit = self._fits.get(backend)
        if fit is None:
            return fleet
        if now - fit.lined_at > self._stale:
            sums = fit.sums
            # The prior weighs against the replica's own weight decayed to now.
            keep = sums.weight_at(now, self._half_life) / sums.weight if sums.weight else 0.0
            mean, var = self._work_moments()
            prior = _hopeful(fleet, sums.line(), mean)
            own = _decayed(sums, keep)
            line = own.line(prior, _RIDGE, mean, var) if keep > 1e-9 else None
            fit.line = line or prior
            fit.spread = own.spread(line) if line is not None else self._fleet.spread
            fit.lined_at = now
        return fit.line

    def spread(self, backend: str) -> float:
        """How uncertain `backend`'s line is now (the standard error of its mean time,
        seconds): a difference in predictions within it is noise, not a faster replica."""
        fit = self._fits.get(backend)
        if fit is None or self.line(backend) is None:
            return self._fleet.spread
        return fit.spread

    def seconds(self, backend: str, work_tokens: float) -> float | None:
        """The predicted time to first token at `backend` for `work_tokens` of work."""
        line = self.line(backend)
        return None if line is None else line.seconds(work_tokens)

    def least_gain(self) -> float:
        """The fleet line's intercept, what any request costs with nothing to compute (0
        before anything is learned): a prediction sooner by less is within a request's jitter,
        not worth leaving the rule's choice for."""
        line = self._fleet_line(self._clock())
        return 0.0 if line is None else line.intercept

    def slowness(self) -> dict[str, float]:
        """The replicas clearly slower than the typical replica, each with how many times:
        their predicted time for the fleet's mean work over the typical replica's (the lower
        median of those times), where that is at least `margin`. Empty on an even fleet and
        before anything is learned. The policy counts their recent requests and pending
        prefill that many times over: a replica three times slower has had its share with a
        third of the requests."""
        now = self._clock()
        if now - self._slow_at > self._stale:
            self._slow_at = now
            mean, _ = self._work_moments()
            times = {}
            for name in self._fits:
                line = self.line(name)
                if line is not None:
                    times[name] = line.seconds(mean)
            ordered = sorted(times.values())
            typical = ordered[(len(ordered) - 1) // 2] if ordered else 0.0
            self._slow = (
                {
                    name: seconds / typical
                    for name, seconds in times.items()
                    if seconds >= self._margin * typical
                }
                if typical > 0
                else {}
            )
        return self._slow

    def forget(self, backend: str) -> None:
        """`backend` left the pool."""
        self._fits.pop(backend, None)
        self._slow.pop(backend, None)

    def _fleet_line(self, now: float) -> Line | None:
        fleet = self._fleet
        if now - fleet.lined_at > self._stale:
            weight = fleet.sums.weight_at(now, self._half_life * _FLEET_MEMORY)
            enough = weight >= self._min_weight
            fleet.line = fleet.sums.line() if enough else None
            fleet.spread = fleet.sums.spread(fleet.line) if fleet.line is not None else 0.0
            fleet.lined_at = now
        return fleet.line

    def _work_moments(self) -> tuple[float, float]:
        """The mean and variance of the fleet's work per observation."""
        sums = self._fleet.sums
        if not sums.weight:
            return 0.0, 0.0
        mean = sums.xs / sums.weight
        return mean, max(sums.xx / sums.weight - mean * mean, 0.0)


def _hopeful(fleet: Line, past: Line | None, mean: float) -> Line:
    """What a replica's fit forgets toward: the fleet's line, or the replica's own past where
    that answered sooner. The fleet's line is made of what this gateway sent, which may be
    mostly a slow replica's answers; a fast replica it has stopped sending to would be
    forgotten into them, and never tried again."""
    if past is not None and past.seconds(mean) < fleet.seconds(mean):
        return past
    return fleet


def _decayed(sums: _Sums, keep: float) -> _Sums:
    """A copy of `sums` with every sum scaled by `keep`."""
    copy = _Sums()
    copy.weight, copy.xs, copy.ys = sums.weight * keep, sums.xs * keep, sums.ys * keep
    copy.xx, copy.xy, copy.yy = sums.xx * keep, sums.xy * keep, sums.yy * keep
    return copy
