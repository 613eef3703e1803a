"""check_stop: the token-level finish conditions the scheduler can judge without a tokenizer."""

from __future__ import annotations

from tidal.request import Request, RequestStatus


def check_stop(request: Request, token_id: int) -> RequestStatus | None:
    """Status to finish with after `token_id` was appended to the outputs, or None to go on.

    EOS and stop_token_ids count once min_tokens outputs exist and win over a length limit
    reached by the same token (finish reason "stop", as in vLLM); max_tokens and max_model_len
    always apply. Stop strings need the detokenizer: engine/output.py checks them.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.max_model_len is not None and request.num_tokens >= request.max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
