"""DraftPlanner: which decodes check prompt-lookup drafts in a step, and how many each.

A draft is one more row of the step (the model, the LM head, the sampler) and pays off only if
it is kept. Position j of a sequence's draft is kept only if positions 1..j all were, so with a
per-position acceptance rate p it brings p^j tokens on average. Each sequence's p is estimated
from its own recent proposals: the ones it checked (how far the model agreed) and the ones it did
not (whether its next token was the proposal's first), so a sequence whose guesses stop coming
true stops paying rows for them, and one that starts copying its context gets them back.

Step cost, in rows: reading the weights costs `speculative_step_rows` rows' worth, then every
row one more. A step of D decodes brings D tokens for `step_rows + D`; one more row with keep
probability v raises the tokens per cost iff v >= tokens / cost. Positions are taken best first
while that holds, so a single sequence checks drafts down to a ~11% chance while 16 decodes
need two chances in three (at 8 rows: 1/9 and 16/24). Where the kernels compute rows in blocks
(AMX tiles of 16 rows of x), a row past a block pays for the block's padding too: 16 decodes
check drafts only if enough of them are likely kept to be worth most of a block. Deterministic:
it reads no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.scheduler import SchedulerConfig
from tidal.request import Request
from tidal.scheduler.ngram import NgramProposer

# Each observation keeps this share of the earlier evidence: about the last ten proposals count.
DECAY = 0.9
# The prior, in observations: one kept and one not (p = 0.5 before anything is seen).
PRIOR_KEPT, PRIOR_MISSED = 1.0, 1.0
# What a padded row of a partly filled block costs against a real row: the block's integer
# products are paid for in full, the rest of a row's work (attention, norms, the float steps,
# the sampler) only for real rows. Measured on 2 Xeon cores (AMX, bundled model): a step of 17
# rows took 1.28x one of 16, 20 rows 1.35x of 16 (each row ~1 ms, the weights' read ~8-12 rows).
PADDED_ROW_COST = 0.5


@dataclass(slots=True)
class _Record:
    kept: float = 0.0  # decayed count of draft positions the model agreed with
    missed: float = 0.0  # decayed count of first disagreements
    # The last proposal, checked against the tokens once they exist: its first position, its
    # tokens, and how many of them the step checked (0: none, then only the first is compared).
    at: int = -1
    proposal: tuple[int, ...] = ()
    checked: int = 0

    @property
    def rate(self) -> float:
        return (self.kept + PRIOR_KEPT) / (self.kept + self.missed + PRIOR_KEPT + PRIOR_MISSED)


class DraftPlanner:
    def __init__(self, config: SchedulerConfig, row_block: int = 1) -> None:
        self.config = config
        # Past this many rows the weight kernels compute rows in blocks of this many (AMX tiles
        # of 16): a 17th row pays for a second tile's integer products.
        self.row_block = row_block
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self._records: dict[str, _Record] = {}
        # This step's proposals, until `scheduled` says how much of each was checked.
        self._pending: dict[str, list[int]] = {}

    def plan(self, decodes: list[Request], spare: int) -> dict[str, list[int]]:
        """Drafts for this step's decodes, at most `spare` tokens in all. Requests absent from
        the result check none; call `scheduled` for each decode once its draft is final."""
        self._pending = {}
        if len(decodes) > self.config.speculative_max_num_seqs:
            # Every running request that once proposed keeps an index (32 chats of 6,000 tokens:
            # ~70 MiB); past twice the drafting batch they go, and a batch that moves around the
            # threshold does not rebuild them every step (~15 ms for 6,000 tokens).
            if len(self.proposer) > 2 * self.config.speculative_max_num_seqs:
                self.proposer.clear()
            return {}
        k_max = self.config.num_speculative_tokens
        proposals: dict[str, list[int]] = {}
        candidates: list[tuple[float, int, int]] = []  # (keep probability, order, position)
        for order, request in enumerate(decodes):
            record = self._observe(request)
            cap = self._cap(request)
            if cap <= 0:
                continue
            proposal = self.proposer.propose(request.request_id, request.all_token_ids, k_max)
            if not proposal:
                continue
            proposals[request.request_id] = proposal
            rate = record.rate
            candidates += [(rate**j, order, j) for j in range(1, min(cap, len(proposal)) + 1)]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        # The best prefix of the candidates (each request's positions come in order, p^j falling
        # with j): the most tokens per cost, the fewest drafts on a tie.
        num_decodes = len(decodes)
        best, best_ratio, tokens = 0, num_decodes / self._cost(num_decodes), float(num_decodes)
        for taken, (value, _, _) in enumerate(candidates[: max(spare, 0)], start=1):
            tokens += value
            ratio = tokens / self._cost(num_decodes + taken)
            if ratio > best_ratio:
                best, best_ratio = taken, ratio
        lengths = [0] * num_decodes
        for _, order, position in candidates[:best]:
            lengths[order] = position
        plan: dict[str, list[int]] = {}
        for request, n in zip(decodes, lengths, strict=True):
            if n:
                plan[request.request_id] = proposals[request.request_id][:n]
        self._pending = proposals
        return plan

    def _cost(self, rows: int) -> float:
        """A step of `rows` rows, in rows: the weights' read, then each row, and past the first
        block the padding of the last one."""
        block, padding = self.row_block, 0
        if rows > block:
            padding = -(-rows // block) * block - rows
        return self.config.speculative_step_rows + rows + PADDED_ROW_COST * padding

    def scheduled(self, request: Request, num_drafts: int) -> None:
        """Remember the request's proposal and how much of it this step checks."""
        proposal = self._pending.pop(request.request_id, None)
        record = self._records.get(request.request_id)
        if proposal is None or record is None:
            return
        record.at, record.proposal, record.checked = request.num_tokens, tuple(proposal), num_drafts

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self._records.pop(request_id, None)

    def _cap(self, request: Request) -> int:
        """The most drafts the request may check: none for a grammar-constrained request (its
        matcher would have to walk each draft) nor one still prefilling, none past max_tokens
        (a step emits up to k + 1 tokens) or the context (the last draft's position must exist)."""
        if (
            request.sampling_params.structured_outputs is not None
            or request.num_computed_tokens < request.num_prompt_tokens
        ):
            return 0
        k = self.config.num_speculative_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        if request.max_model_len is not None:
            k = min(k, request.max_model_len - request.num_tokens)
        return k

    def _observe(self, request: Request) -> _Record:
        """The request's record, updated by its last proposal where its tokens now exist."""
        record = self._records.get(request.request_id)
        if record is None:
            record = self._records[request.request_id] = _Record()
            return record
        if not record.proposal or request.num_tokens <= record.at:
            return record
        known = request.all_token_ids[record.at : record.at + max(record.checked, 1)]
        kept = 0
        while kept < len(known) and known[kept] == record.proposal[kept]:
            kept += 1
        record.kept = DECAY * record.kept + kept
        record.missed = DECAY * record.missed + (kept < len(known))
        record.proposal = ()
        return record
