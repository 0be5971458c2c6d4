"""A prefill worker's time for prompts, fitted from the times it took.

    cost = PrefillCost()
    cost.record(Work.prompt(1024), seconds=2.03)      # a prompt that had the worker alone
    cost.seconds(Work.prompt(128) + Work.prompt(512))  # predicted; None until fitted

Model: seconds = a * requests + b * tokens + c * square, a, b, c >= 0, where a prompt's
`tokens` are those it computes (n - cached) and its `square` is n^2 - cached^2: the
attention part of a prefill grows with the square of the prompt's length, so one rate per
token cannot fit short and long prompts at once (SmolLM2-135M on one core of an AVX-512
EPYC: 655 tokens/s at 128 tokens, 505 at 1,024). `a` is the fixed cost of a request.

The fit is least squares of the relative error over the samples (prompts against their
time to the first token; the router records only prompts that had the worker to
themselves, WorkerState.record_prefill): a short prompt's 0.2 s counts as much as a long
one's 2 s. Each older sample weighs FORGET times less, so the fit follows a worker whose
speed changes. Coefficients that would come out negative are
dropped (the best fit over the remaining features). Until the samples span prompts of
different sizes (mean tokens per request at least SPREAD apart) only the per-token term
is fitted: from prompts of one size the three terms cannot be told apart, and a rate per
token is the safe way to extrapolate. Nothing is predicted before MIN_SAMPLES samples.
"""

from __future__ import annotations

from dataclasses import dataclass

FORGET = 0.95        # weight of a sample relative to the next one
MIN_SAMPLES = 4      # samples before the fit predicts
SPREAD = 2.0         # ratio of the largest to the smallest sample's tokens per request
# the feature sets tried, in order of preference when they fit equally well
_SUBSETS = ((0, 1, 2), (1, 2), (0, 1), (1,), (0, 2), (2,), (0,))
_SCALE = (1.0, 1e-3, 1e-6)   # features scaled so that the normal equations stay conditioned


@dataclass(frozen=True)
class Work:
    """Prefill work: how many requests, tokens to compute and their attention square."""

    requests: int = 0
    tokens: int = 0
    square: float = 0.0

    @staticmethod
    def prompt(tokens: int, cached: int = 0) -> "Work":
        """One prompt of `tokens` tokens whose first `cached` come from the prefix cache."""
        if not 0 <= cached <= tokens:
            raise ValueError(f"need 0 <= cached <= tokens, got {cached} and {tokens}")
        return Work(1, tokens - cached, float(tokens * tokens - cached * cached))

    def __add__(self, other: "Work") -> "Work":
        return Work(self.requests + other.requests, self.tokens + other.tokens,
                    self.square + other.square)

    def __sub__(self, other: "Work") -> "Work":
        return Work(self.requests - other.requests, self.tokens - other.tokens,
                    self.square - other.square)

    def features(self) -> tuple[float, float, float]:
        return (self.requests * _SCALE[0], self.tokens * _SCALE[1], self.square * _SCALE[2])


class PrefillCost:
    """seconds = a * requests + b * tokens + c * square, fitted as the samples come."""

    def __init__(self) -> None:
        # w = FORGET^age / y^2: least squares of (y - coef . x) / y
        self._xx = [[0.0] * 3 for _ in range(3)]   # sum of w x x^T
        self._xy = [0.0] * 3                       # sum of w x y
        self._yy = 0.0                             # sum of w y^2
        self.samples = 0
        self._sizes: tuple[float, float] | None = None  # least and most tokens per request
        self._coef: tuple[float, float, float] | None = None

    def record(self, work: Work, seconds: float) -> None:
        """`work` took `seconds` to its (last prompt's) first token."""
        if not seconds > 0 or work.requests < 1 or work.tokens < 0 or work.square < 0:
            raise ValueError(f"need seconds > 0 and a request's work, got {seconds} s for "
                             f"{work}")
        x = [v / seconds for v in work.features()]   # weighted by 1 / seconds^2
        for i in range(3):
            self._xy[i] = FORGET * self._xy[i] + x[i]
            for j in range(3):
                self._xx[i][j] = FORGET * self._xx[i][j] + x[i] * x[j]
        self._yy = FORGET * self._yy + 1.0
        self.samples += 1
        size = work.tokens / work.requests
        lo, hi = self._sizes or (size, size)
        self._sizes = (min(lo, size), max(hi, size))
        self._coef = self._fit() if self.samples >= MIN_SAMPLES else None

    @property
    def fitted(self) -> bool:
        """Whether `seconds` predicts (enough samples, and a fit found)."""
        return self._coef is not None

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(s per request, s per token, s per squared token), or None before a fit."""
        if self._coef is None:
            return None
        return tuple(c * s for c, s in zip(self._coef, _SCALE))

    def seconds(self, work: Work) -> float | None:
        """Predicted seconds for `work`; None until fitted."""
        if self._coef is None:
            return None
        return sum(c * x for c, x in zip(self._coef, work.features()))

    def _fit(self) -> tuple[float, float, float] | None:
        """The non-negative least-squares coefficients over the best subset of features
        (within 1% of the least residual, the earlier in _SUBSETS)."""
        lo, hi = self._sizes
        spread = lo > 0 and hi / lo >= SPREAD
        fits = []
        for keep in _SUBSETS if spread else ((1,),):
            coef = _solve([[self._xx[i][j] for j in keep] for i in keep],
                          [self._xy[i] for i in keep])
            if coef is None or any(c < 0 for c in coef):
                continue
            full = [0.0, 0.0, 0.0]
            for i, c in zip(keep, coef):
                full[i] = c
            fits.append((self._residual(full), tuple(full)))
        if not fits:
            return None
        least = min(err for err, _ in fits)
        return next(coef for err, coef in fits if err <= least * 1.01 + 1e-12)

    def _residual(self, coef: list[float]) -> float:
        """sum of w (y - coef . x)^2, from the kept sums."""
        quad = sum(coef[i] * self._xx[i][j] * coef[j] for i in range(3) for j in range(3))
        return self._yy - 2 * sum(c * v for c, v in zip(coef, self._xy)) + quad


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Gaussian elimination, partial pivoting); None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0.0:
        return None
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-9 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
