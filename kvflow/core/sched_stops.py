"""The stop rule on one request after a step: its sampled tokens appended until one finishes
it (EOS or a stop id once ``min_tokens`` are out, the length limit, a repeated n-gram, a token
its grammar rejects or one that terminates the grammar). Used by ``sched_update``.
"""

from __future__ import annotations

from kvflow.request import Request, RequestStatus
from kvflow.sampling.repetition_detection import REPETITION_STOP_REASON, ends_with_repetition


def append_tokens(request: Request, token_ids: list[int]) -> list[int]:
    """Append tokens until one finishes the request (a stop, the length limit, a token the
    grammar rejects or one that terminates it) or its grammar matcher fails (the request is
    then left running, its ``structured_output.error`` set); returns those appended."""
    appended = []
    for token_id in token_ids:
        if request.structured_output is not None and (
                banned_by_min_tokens(request, token_id) or
                not request.structured_output.accept_token(token_id)):
            # the grammar admits no further token: the output is cut here (the matcher
            # advances before the token is appended, so both always agree); a matcher that
            # raised (``structured_output.error``) is left to the caller, which ends the
            # request with that error
            if request.structured_output.error is None:
                request.status = RequestStatus.FINISHED_LENGTH
            break
        request.all_token_ids.append(token_id)
        appended.append(token_id)
        if request.structured_output is not None and \
                request.structured_output.is_terminated():
            # the grammar took its stop token, the EOS (which ``ignore_eos`` keeps check_stop
            # from stopping on): the output is complete and nothing may follow, so ``stop``,
            # also when it was the last token ``max_tokens`` allowed
            request.status = RequestStatus.FINISHED_STOPPED
            break
        if check_stop(request, token_id):
            break
    return appended


def banned_by_min_tokens(request: Request, token: int) -> bool:
    """Whether ``min_tokens`` bans ``token`` as the request's next token (a stop token
    before ``min_tokens`` are out). Sampled anyway, it came from a row that allowed nothing:
    a grammar whose only way on is the EOS that ``min_tokens`` bans (the row's logits all
    -inf, its "sample" id 0, which is the EOS of some vocabularies)."""
    if len(request.all_token_ids) >= request.min_stop_len:
        return False
    return token == request.stop_eos_id or token in request.sampling_params.stop_token_ids


def check_stop(request: Request, token: int) -> bool:
    """Finish the request if ``token`` (just appended) stops it; returns whether it did.
    EOS and stop ids count once ``min_tokens`` are out (they were masked until then); the
    length limit is ``max_tokens`` or ``max_model_len``, whichever comes first."""
    num_tokens = len(request.all_token_ids)
    if num_tokens > request.min_stop_len:
        if token == request.stop_eos_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token in request.sampling_params.stop_token_ids:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
            return True
    if num_tokens >= request.max_num_tokens:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return check_repetition(request)


def check_repetition(request: Request) -> bool:
    """Finish the request with reason ``repetition`` (stop reason ``repetition_detected``)
    if its ``repetition_detection`` finds its generated tokens ending with a repeated n-gram,
    once ``min_tokens`` are out (vLLM 0.32's ``check_stop`` order: after EOS, stop ids and
    the length limit); returns whether it did. Reads only the tail a pattern can span."""
    detection = request.sampling_params.repetition_detection
    num_tokens = len(request.all_token_ids)
    if detection is None or num_tokens < request.min_stop_len:
        return False
    start = max(request.num_prompt_tokens,
                num_tokens - detection.max_pattern_size * detection.min_count)
    if not ends_with_repetition(request.all_token_ids[start:], detection):
        return False
    request.status, request.stop_reason = RequestStatus.FINISHED_REPETITION, \
        REPETITION_STOP_REASON
    return True
