"""The OpenAI protocol layer: request parsing, sampling params, prompts, response and SSE JSON."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from transformers import PreTrainedTokenizerFast

from splitserve.cluster.openai_api import (
    SSE_DONE,
    ChatCompletionRequest,
    ChatResponseBuilder,
    CompletionRequest,
    CompletionResponseBuilder,
    OpenAIError,
    chat_prompt,
    completion_prompt,
    context_length_exceeded,
    error_body,
    error_event,
    model_not_found,
    overloaded,
    parse_request,
    response_builder,
    sse_event,
    sse_stream,
)
from splitserve.cluster.openai_api.logprobs import CompletionLogprobs, TokenTexts
from splitserve.sampling_params import SamplingParams
from splitserve.workers.model.tokenizer import tiny_tokenizer
from splitserve.workers.output.request_output import CompletionOutput, RequestOutput
from splitserve.workers.sampling.sampler import TokenLogprobs

TOK = tiny_tokenizer()
VOCAB = 512  # the tiny presets' embedding rows (the tokenizer has fewer)
MESSAGES = [{"role": "user", "content": "hi"}]
PROMPT_IDS = [441, 431, 3]  # "Hello world!"
HEADER = {"id": "req-1", "created": 1700000000, "model": "tiny"}


def parse_error(kind: str, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        parse_request(kind, body)
    return e.value


def completion(**fields) -> CompletionRequest:
    return parse_request("completions", {"prompt": "Hello", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return parse_request("chat", {"messages": MESSAGES, **fields})


# --- parsing


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("Hello", "Hello"), ([5, 6], [5, 6]), (["Hello"], "Hello"), ([[5, 6]], [5, 6])],
)
def test_completion_prompt_forms(prompt, expected):
    assert parse_request("completions", {"prompt": prompt}).prompt == expected


def test_full_completion_body_is_kept():
    req = completion(
        model="tiny", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, stop=["\n"], logprobs=2, echo=False, n=1,
        user="u", return_token_ids=True, tools=None, logit_bias=None,
        response_format={"type": "text"}, tool_choice="none", best_of=1,
    )  # fmt: skip
    assert (req.model, req.max_tokens, req.temperature, req.stop, req.logprobs) == (
        "tiny", 5, 0.0, ["\n"], 2,
    )  # fmt: skip
    assert req.include_usage and req.return_token_ids


def test_chat_content_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = parse_request("chat", {"messages": [{"role": "user", "content": parts}]})
    assert req.messages[0].content == "a\nb"


@pytest.mark.parametrize(
    ("kind", "body", "param", "message"),
    [
        ("completions", [1], None, "the request body must be a JSON object, got an array"),
        ("chat", None, None, "the request body must be a JSON object, got null"),
        ("completions", {}, "prompt", "'prompt' is required"),
        ("completions", {"prompt": ["a", "b"]}, "prompt",
         "invalid 'prompt': a batch of 2 prompts is not supported: send one per request"),
        ("completions", {"prompt": [[1], [2], [3]]}, "prompt", "a batch of 3 prompts"),
        ("completions", {"prompt": []}, "prompt", "the prompt is empty"),
        ("completions", {"prompt": [1.5]}, "prompt",
         "must be a string, a list of token ids, or a list holding one of those; got [1.5]"),
        ("completions", {"prompt": "x", "temperature": "0.5"}, "temperature",
         "invalid 'temperature': Input should be a valid number, got '0.5'"),
        ("completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens",
         "invalid 'max_tokens': Input should be a valid integer, got 1.5"),
        ("completions", {"prompt": "x", "stream": 1}, "stream", "Input should be a valid boolean"),
        ("completions", {"prompt": "x", "foo": 1}, "foo", "unknown field 'foo'"),
        ("completions", {"prompt": "x", "tools": [{"type": "function"}]}, "tools",
         "'tools' is not supported by this server (leave it out or send null)"),
        ("completions", {"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias",
         "'logit_bias' is not supported"),
        ("chat", {"messages": MESSAGES, "response_format": {"type": "json_object"}},
         "response_format", "'response_format' is not supported"),
        ("completions", {"prompt": "x", "n": 2}, "n",
         "invalid 'n': must be 1 (this server returns one choice per request)"),
        ("completions", {"prompt": "x", "logprobs": 21}, "logprobs",
         "invalid 'logprobs': Input should be less than or equal to 20, got 21"),
        ("completions", {"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
        ("completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo",
         "echo=true with logprobs is not supported"),
        ("completions", {"prompt": "x", "skip_special_tokens": False}, "skip_special_tokens",
         "skip_special_tokens=false is not supported"),
        ("completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options", "stream_options is only allowed with stream=true"),
        ("completions", {"prompt": "x", "stream": True, "stream_options": {"x": 1}},
         "stream_options.x", "unknown field 'stream_options.x'"),
        ("completions", {"prompt": "x", "stop": [1]}, "stop",
         "invalid 'stop': must be a string or a list of strings, got [1]"),
        ("chat", {}, "messages", "'messages' is required"),
        ("chat", {"messages": []}, "messages", "invalid 'messages': give at least one message"),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role",
         "role 'tool' is not supported; accepted: system, developer, user, assistant"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content", "only text parts are supported"),
        ("chat", {"messages": [MESSAGES[0], {"role": "user", "content": 5}]},
         "messages[1].content", "Input should be a valid string"),
        ("chat", {"messages": ["hi"]}, "messages[0]", "invalid 'messages[0]'"),
        ("chat", {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs",
         "top_logprobs needs logprobs=true"),
        ("chat", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
         "less than or equal to 20"),
    ],
)  # fmt: skip
def test_bad_bodies_name_the_field(kind, body, param, message):
    err = parse_error(kind, body)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert message in err.message


def test_several_errors_are_reported_together():
    err = parse_error("completions", {"prompt": "x", "top_p": "high", "bogus": 1})
    assert err.message == (
        "invalid 'top_p': Input should be a valid number, got 'high'; unknown field 'bogus'"
    )
    assert err.param == "top_p"


def test_unknown_kind_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown request kind 'completion'"):
        parse_request("completion", {"prompt": "x"})


# --- sampling params


def test_completion_sampling_params_map_every_field():
    req = completion(
        max_tokens=7, temperature=0.5, top_p=0.9, stop="END", seed=3, logprobs=4,
        presence_penalty=0.1, frequency_penalty=-0.2, top_k=-1, min_p=0.05,
        repetition_penalty=1.1, min_tokens=2, ignore_eos=True, stop_token_ids=[9],
        include_stop_str_in_output=True,
    )  # fmt: skip
    assert req.to_sampling_params(100) == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, stop=["END"], seed=3, logprobs=4,
        presence_penalty=0.1, frequency_penalty=-0.2, top_k=0, min_p=0.05,
        repetition_penalty=1.1, min_tokens=2, ignore_eos=True, stop_token_ids=[9],
        include_stop_str_in_output=True,
    )  # fmt: skip


def test_defaults_follow_openai_and_fill_the_context():
    params = completion().to_sampling_params(100)
    assert params == SamplingParams(max_tokens=100, temperature=1.0)
    assert params.logprobs is None and params.stop == []


def test_chat_sampling_params():
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params(100).max_tokens == 9
    assert chat(max_tokens=5).to_sampling_params(100).max_tokens == 5
    assert chat(logprobs=True, top_logprobs=3).to_sampling_params(100).logprobs == 3
    assert chat(logprobs=True).to_sampling_params(100).logprobs == 0
    assert chat(logprobs=False, top_logprobs=0).to_sampling_params(100).logprobs is None


@pytest.mark.parametrize(
    ("req", "param", "message"),
    [
        (completion(temperature=-1), "temperature",
         "invalid temperature=-1.0: must be >= 0 (0 means greedy)"),
        (completion(top_k=-3), "top_k", "invalid top_k=-3: must be an integer in [-1, 2147483647]"),
        (completion(max_tokens=0), "max_tokens",
         "invalid max_tokens=0: must be an integer in [1, 2147483647]"),
        (chat(max_completion_tokens=0), "max_completion_tokens", "invalid max_tokens=0"),
        (completion(max_tokens=2, min_tokens=3), "min_tokens",
         "invalid min_tokens=3: must be an integer in [0, max_tokens=2]"),
        (completion(stop=""), "stop", "invalid stop=['']: must be a list of non-empty strings"),
        (completion(presence_penalty=3), "presence_penalty",
         "invalid presence_penalty=3.0: must be in [-2, 2]"),
    ],
)  # fmt: skip
def test_sampling_param_errors_reach_the_caller(req, param, message):
    with pytest.raises(OpenAIError) as e:
        req.to_sampling_params(100)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(message)


def test_a_full_context_leaves_no_default_max_tokens():
    with pytest.raises(OpenAIError) as e:
        completion().to_sampling_params(0)
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
    assert completion(max_tokens=4).to_sampling_params(0).max_tokens == 4  # the engine caps it


# --- prompts


def test_completion_prompts():
    assert completion_prompt(completion(), TOK, VOCAB) == ("Hello", [441])
    assert completion_prompt(completion(prompt=["hello world"]), TOK, VOCAB) == (
        "hello world",
        [394, 431],
    )
    assert completion_prompt(completion(prompt=[[5, 6, 511]]), TOK, VOCAB) == (None, [5, 6, 511])


@pytest.mark.parametrize("ids", [[1, 512], [-1, 3]])
def test_out_of_vocabulary_ids_are_rejected(ids):
    with pytest.raises(OpenAIError) as e:
        completion_prompt(completion(prompt=ids), TOK, VOCAB)
    bad = [t for t in ids if t in (512, -1)]
    assert e.value.message == f"prompt token ids {bad} are out of range: ids must be in [0, 512)"
    assert (e.value.status, e.value.param) == (400, "prompt")


def test_chat_prompt_applies_the_template():
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text, ids = chat_prompt(parse_request("chat", {"messages": messages}), TOK, VOCAB)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    opening = TOK.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[0] == 1 and ids[-len(opening) :] == opening
    assert ids.count(1) == 3 and ids.count(2) == 2  # the role markers are single special tokens
    assert TOK.decode(ids) == text


def test_chat_without_a_template_or_with_a_failing_one():
    plain = PreTrainedTokenizerFast(tokenizer_object=TOK.backend_tokenizer)
    with pytest.raises(OpenAIError, match="no chat template: use /v1/completions") as e:
        chat_prompt(chat(), plain)
    assert (e.value.status, e.value.param) == (400, "messages")
    strict = PreTrainedTokenizerFast(
        tokenizer_object=TOK.backend_tokenizer,
        chat_template="{{ raise_exception('roles must alternate') }}",
    )
    with pytest.raises(OpenAIError, match="the chat template rejected the messages: roles must"):
        chat_prompt(chat(), strict)


# --- responses


def delta(text, ids, finish=None, stop_reason=None, logprobs=None, cached=0, error=None):
    out = CompletionOutput(0, text, ids, finish, stop_reason, logprobs)
    return RequestOutput("r", None, PROMPT_IDS, [out], finish is not None, cached, error=error)


def builder(req, **kw):
    created = HEADER["created"]
    return response_builder(req, TOK, PROMPT_IDS, "tiny", request_id="req-1", created=created, **kw)


def feed(b, *outputs):
    for out in outputs:
        b.add(out)
    return b


USAGE_3_OF_3 = {
    "prompt_tokens": 3,
    "completion_tokens": 3,
    "total_tokens": 6,
    "prompt_tokens_details": {"cached_tokens": 2},
}
DELTAS = [delta("Hel", [10]), delta("", [11]), delta("lo", [12], "stop", "END", cached=2)]


def test_completion_response():
    assert feed(builder(completion()), *DELTAS).response() == {
        **HEADER,
        "object": "text_completion",
        "choices": [
            {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop",
             "stop_reason": "END"}
        ],
        "usage": USAGE_3_OF_3,
    }  # fmt: skip


def test_chat_response_with_token_ids():
    b = feed(builder(chat(return_token_ids=True)), *DELTAS)
    assert b.response(cached_tokens=1) == {
        **HEADER,
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
             "finish_reason": "stop", "stop_reason": "END", "token_ids": [10, 11, 12]}
        ],
        "prompt_token_ids": PROMPT_IDS,
        "usage": {**USAGE_3_OF_3, "prompt_tokens_details": {"cached_tokens": 1}},
    }  # fmt: skip


def test_ids_and_builder_kinds():
    req_c, req_chat = completion(), chat()
    assert isinstance(response_builder(req_c, TOK, [1], "m"), CompletionResponseBuilder)
    assert isinstance(response_builder(req_chat, TOK, [1], "m"), ChatResponseBuilder)
    assert response_builder(req_c, TOK, [1], "m").id.startswith("cmpl-")
    assert response_builder(req_chat, TOK, [1], "m").id.startswith("chatcmpl-")


@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
def test_finish_reasons_pass_through(reason):
    b = feed(builder(completion()), delta("a", [5], reason))
    assert b.finished and b.response()["choices"][0]["finish_reason"] == reason


def test_a_failed_request_raises():
    b = builder(completion())
    with pytest.raises(OpenAIError) as e:
        b.add(delta("", [], "error", error="worker lost"))
    assert (e.value.status, e.value.type, e.value.message) == (500, "server_error", "worker lost")
    with pytest.raises(OpenAIError, match="the request failed in the engine"):
        b.add(delta("", [], "error"))


def test_echo_prepends_the_prompt():
    b = feed(builder(completion(echo=True), prompt_text="Hello world!"), delta(" Hi", [5], "stop"))
    assert b.response()["choices"][0]["text"] == "Hello world! Hi"
    s = builder(completion(echo=True))  # a token-id prompt: the ids decoded
    assert [c["choices"][0]["text"] for c in s.chunks(delta(" A", [5]))] == ["Hello world! A"]
    assert [c["choices"][0]["text"] for c in s.chunks(delta(" B", [6]))] == [" B"]


# --- logprobs

HELLO_IDS = [74, 130, 105, 307]  # "héllo": 'é' is two byte tokens


def steps(ids, top_ids=(74, 441)):
    """Step i samples ids[i] at logprob -0.5 i; top_ids[j] has logprob -j."""
    top = [(u, -1.0 * j) for j, u in enumerate(top_ids)]
    return [TokenLogprobs(t, -0.5 * i, top) for i, t in enumerate(ids)]


def test_completion_logprobs_format():
    out = delta("héllo", HELLO_IDS, "length", None, steps(HELLO_IDS))
    b = feed(builder(completion(logprobs=2)), out)
    assert b.response()["choices"][0]["logprobs"] == {
        "tokens": ["h", "bytes:\\xc3", "bytes:\\xa9", "llo"],
        "token_logprobs": [0.0, -0.5, -1.0, -1.5],
        "top_logprobs": [{"h": 0.0, "Hello": -1.0}] * 4,
        "text_offset": [0, 1, 1, 2],
    }


def test_completion_logprobs_stream_keeps_offsets_and_clamps_infinity():
    b = builder(completion(logprobs=0))
    first = b.chunks(delta("h", [74], logprobs=steps([74], ())))
    tail = [TokenLogprobs(130, -math.inf, []), TokenLogprobs(105, -2.0, [])]
    second = b.chunks(delta("é", [130, 105], logprobs=tail))
    assert first[0]["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second[0]["choices"][0]["logprobs"] == {
        "tokens": ["bytes:\\xc3", "bytes:\\xa9"],
        "token_logprobs": [-9999.0, -2.0],
        "top_logprobs": [{}, {}],
        "text_offset": [1, 1],
    }


def test_chat_logprobs_format():
    out = delta("h", HELLO_IDS[:2], logprobs=steps(HELLO_IDS[:2], (441,)))
    b = feed(builder(chat(logprobs=True, top_logprobs=1)), out)
    assert b.response()["choices"][0]["logprobs"] == {
        "content": [
            {"token": "h", "logprob": 0.0, "bytes": [104],
             "top_logprobs": [{"token": "Hello", "logprob": 0.0, "bytes": list(b"Hello")}]},
            {"token": "bytes:\\xc3", "logprob": -0.5, "bytes": [0xC3],
             "top_logprobs": [{"token": "Hello", "logprob": 0.0, "bytes": list(b"Hello")}]},
        ]
    }  # fmt: skip


class SentencePieceLike:
    """The three calls TokenTexts makes, for a vocabulary with ▁ and byte-fallback pieces."""

    pieces = ["\u2581the", "<0xE4>", "</s>"]

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, token_id):
        return self.pieces[token_id]

    def decode(self, ids, skip_special_tokens=False):
        text = {0: "the", 1: "\ufffd", 2: "</s>"}[ids[0]]
        return "" if skip_special_tokens and ids[0] == 2 else text


def test_token_texts_of_sentencepiece_pieces():
    texts = TokenTexts(SentencePieceLike())
    assert [(t.token, t.raw, t.in_text) for t in map(texts, [0, 1, 2, 7])] == [
        (" the", b" the", True),
        ("bytes:\\xe4", b"\xe4", True),
        ("</s>", b"</s>", False),
        ("", b"", False),
    ]
    formatted = CompletionLogprobs(texts).format([TokenLogprobs(t, 0.0, []) for t in (0, 2, 0)])
    assert formatted["text_offset"] == [0, 4, 4]  # the special token takes no text


# --- streaming


def texts_of(chunks, key="text"):
    return [c["choices"][0][key] for c in chunks]


def test_completion_stream():
    b = builder(completion(stream=True))
    chunks = [b.chunks(d) for d in DELTAS]
    assert chunks[1] == []  # a held-back partial character: nothing to send
    assert chunks[0] == [
        {**HEADER, "object": "text_completion",
         "choices": [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None,
                      "stop_reason": None}]}
    ]  # fmt: skip
    assert chunks[2][0]["choices"][0] == {
        "index": 0, "text": "lo", "logprobs": None, "finish_reason": "stop", "stop_reason": "END"
    }  # fmt: skip
    assert b.usage_chunk() is None


def test_chat_stream_with_usage():
    b = builder(chat(stream=True, stream_options={"include_usage": True}))
    chunks = [c for d in DELTAS for c in b.chunks(d)]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "req-1" for c in chunks)
    assert texts_of(chunks, "delta") == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert b.usage_chunk() == {
        **HEADER, "object": "chat.completion.chunk", "choices": [], "usage": USAGE_3_OF_3
    }  # fmt: skip


def test_chat_stream_ends_with_an_empty_delta_when_the_last_step_has_no_text():
    b = builder(chat(stream=True))
    b.chunks(delta("Hi", [5]))
    assert b.chunks(delta("", [0], "stop", 0)) == [
        {**HEADER, "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                      "stop_reason": 0}]}
    ]  # fmt: skip


def test_stream_token_ids():
    b = builder(completion(stream=True, return_token_ids=True))
    chunks = [c for d in DELTAS for c in b.chunks(d)]
    assert texts_of(chunks) == ["Hel", "", "lo"]  # with ids asked for, the id-only step is sent
    assert texts_of(chunks, "token_ids") == [[10], [11], [12]]
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks] == [PROMPT_IDS, None, None]
    b = builder(chat(stream=True, return_token_ids=True))
    chunks = [c for d in DELTAS for c in b.chunks(d)]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS
    assert "token_ids" not in chunks[0]["choices"][0]
    assert [ch["choices"][0]["token_ids"] for ch in chunks[1:]] == [[10], [11], [12]]
    assert "prompt_token_ids" not in chunks[1]["choices"][0]


# --- SSE and errors


def test_sse_events():
    assert sse_event({"a": "é", "b": [1, None]}) == 'data: {"a":"é","b":[1,null]}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    err = OpenAIError(500, "boom", "server_error")
    assert error_event(err) == (
        'data: {"error":{"message":"boom","type":"server_error","param":null,"code":null}}\n\n'
    )


def test_error_helpers():
    assert error_body(model_not_found("gpt-4", ["tiny"])) == {
        "error": {
            "message": "the model 'gpt-4' does not exist; this server serves: tiny",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert model_not_found("x").status == 404
    long = context_length_exceeded(70, 64, param="messages", status=413)
    assert (long.status, long.param, long.code) == (413, "messages", "context_length_exceeded")
    assert long.message == (
        "this model's maximum context length is 64 tokens, but the prompt has 70 tokens: "
        "a prompt may have at most 63 tokens"
    )
    busy = overloaded()
    assert (busy.status, busy.type, busy.code) == (503, "server_error", "overloaded")


async def _aiter(items):
    for item in items:
        yield item


def collect(b, outputs) -> list[str]:
    async def run():
        return [event async for event in sse_stream(b, _aiter(outputs))]

    return asyncio.run(run())


def test_sse_stream_ends_with_usage_then_done():
    b = builder(completion(stream=True, stream_options={"include_usage": True}))
    events = collect(b, DELTAS)
    assert len(events) == 4 and events[-1] == SSE_DONE
    assert events[-2].startswith("data: ") and events[-2].endswith("\n\n")
    assert json.loads(events[-2][len("data: ") :]) == {
        **HEADER, "object": "text_completion", "choices": [], "usage": USAGE_3_OF_3
    }  # fmt: skip


def test_sse_stream_reports_a_failure_mid_stream():
    b = builder(completion(stream=True))
    events = collect(b, [delta("Hel", [10]), delta("", [], "error", error="decode worker died")])
    assert events[1:] == [
        'data: {"error":{"message":"request req-1 failed: decode worker died",'
        '"type":"server_error","param":null,"code":null}}\n\n',
        SSE_DONE,
    ]
    assert events[0].startswith('data: {"id":"req-1","object":"text_completion"')


def test_intake_reads_then_accepts_and_counts_the_text_it_tokenizes():
    from splitserve.cluster.openai_api.intake import RequestIntake, text_to_tokenize
    from splitserve.config import RequestLimits

    intake = RequestIntake(tiny_tokenizer(), 512, 1024, ("m",), RequestLimits())
    ids = json.dumps({"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}).encode()
    text = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "abc"}]}).encode()
    assert text_to_tokenize(intake.read("completions", ids)) == 0
    assert text_to_tokenize(intake.read("completions", text)) == len("hello there")
    assert text_to_tokenize(intake.read("chat", chat)) == 3
    read_then_accepted = intake.accept("completions", intake.read("completions", ids))
    assert read_then_accepted.prompt_token_ids == intake.parse("completions", ids).prompt_token_ids
    assert read_then_accepted.prompt_token_ids == [5, 6, 7]
    with pytest.raises(OpenAIError) as e:  # ids checked by min/max, named by the slow path
        intake.parse("completions", json.dumps({"prompt": [1, 600, -1]}).encode())
    assert "600, -1" in e.value.message


def test_parse_async_takes_a_thread_only_for_a_large_body_or_long_text(monkeypatch):
    from splitserve.cluster.openai_api import intake as intake_module
    from splitserve.config import RequestLimits

    handed_off = []
    real_to_thread = asyncio.to_thread

    async def counting_to_thread(fn, *args):
        handed_off.append(fn.__name__)
        return await real_to_thread(fn, *args)

    monkeypatch.setattr(intake_module.asyncio, "to_thread", counting_to_thread)
    intake = intake_module.RequestIntake(tiny_tokenizer(), 512, 100_000, ("m",), RequestLimits())

    def parse(body: dict):
        handed_off.clear()
        result = asyncio.run(intake.parse_async("completions", json.dumps(body).encode()))
        return result.prompt_token_ids, list(handed_off)

    ids = [7] * 2048  # about 6 KB of JSON: read and checked on the event loop
    assert parse({"prompt": ids, "max_tokens": 1}) == (ids, [])
    many = [7] * 20_000  # over INLINE_READ_BYTES: the whole parse in a thread
    assert parse({"prompt": many, "max_tokens": 1}) == (many, ["parse"])
    short, hops = parse({"prompt": "a b", "max_tokens": 1})
    assert hops == [] and short == tiny_tokenizer().encode("a b")
    long_text = "a " * 600  # over INLINE_TOKENIZE_CHARS: read here, tokenized in a thread
    tokens, hops = parse({"prompt": long_text, "max_tokens": 1})
    assert hops == ["accept"] and tokens == tiny_tokenizer().encode(long_text)
