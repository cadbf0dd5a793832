"""The output package (web/render/): a job's events in, each API's frames and bodies out (pure logic)."""

from __future__ import annotations

import json

import pytest
from flask import Flask

from jobs import records
from jobs.events import DELTA, DONE, REASONING, SEGMENT
from web.render import anthropic, jobs, openai, responses, transcripts
from web.render.errors import error_body

USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 4}}
CALL = {"id": "call_ab12", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def delta(text: str, index: int = 0, **extra) -> dict:
    return {"type": DELTA, "data": {"text": text, "index": index, **extra}}


def done(text: str, finish: str = "stop", calls: list | None = None, **choice) -> dict:
    first = {"index": 0, "text": text, "finish_reason": finish, **choice, **({"tool_calls": calls} if calls else {})}
    return {"type": DONE, "data": {"choices": [first], "usage": USAGE, "model": "m"}}


def parse(frames: list[str]) -> list[tuple[str | None, object]]:
    """SSE frames as (event name, data: JSON decoded unless it is not JSON)."""
    parsed = []
    for frame in frames:
        assert frame.endswith("\n\n"), frame
        fields = dict(line.split(": ", 1) for line in frame.strip("\n").split("\n"))
        data = fields["data"]
        parsed.append((fields.get("event"), data if data == "[DONE]" else json.loads(data)))
    return parsed


def run(renderer, events: list[dict]) -> list[tuple[str | None, object]]:
    """Every frame a renderer gives for these events, its closing ones included, parsed."""
    return parse([frame for event in events for frame in renderer.frames(event)] + list(renderer.closing()))


# --- OpenAI -------------------------------------------------------------------------------------

def test_a_chat_stream_opens_each_choice_with_its_role_and_ends_with_usage_and_done():
    out = openai.Chat("chatcmpl-1", "m", 7, include_usage=True, request_id="req_1")
    frames = [data for _, data in run(out, [delta("Hel"), delta("lo"), done("Hello")])]
    assert [f["choices"][0]["delta"] for f in frames[:3]] == [{"role": "assistant", "content": ""},
                                                              {"content": "Hel"}, {"content": "lo"}]
    assert frames[3]["choices"][0]["finish_reason"] == "stop" and frames[3]["usage"] is None
    assert frames[4]["choices"] == [] and frames[4]["usage"] == USAGE
    assert frames[5] == "[DONE]" and len(frames) == 6
    assert {f["id"] for f in frames[:5]} == {"chatcmpl-1"} and frames[0]["object"] == "chat.completion.chunk"


def test_a_chat_streams_each_tool_call_whole_at_its_own_index():
    out = openai.Chat("chatcmpl-1", "m", 7)
    frames = [data for _, data in run(out, [delta("", tool_calls=[CALL]), delta("", tool_calls=[CALL])])][:-1]
    calls = [f["choices"][0]["delta"]["tool_calls"][0] for f in frames if "tool_calls" in f["choices"][0]["delta"]]
    assert [c["index"] for c in calls] == [0, 1]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": CALL["arguments"]}
    assert "usage" not in frames[0]  # not asked for: no usage field at all


def test_a_chat_completion_body_and_a_call_only_message():
    body = openai.Chat("chatcmpl-1", "m", 7).body(done("\n", "tool_calls", [CALL])["data"])
    assert body["object"] == "chat.completion" and body["created"] == 7 and body["usage"] == USAGE
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["id"] == "call_ab12"


def test_completion_logprobs_count_text_offsets_across_deltas():
    entry = lambda token: {"token": token, "logprob": -0.5, "top_logprobs": [{"token": token, "logprob": -0.5}]}  # noqa: E731
    out = openai.Completion("cmpl-1", "m", 7)
    frames = [data for _, data in run(out, [delta("ab", logprobs=[entry("a"), entry("b")]),
                                            delta("c", logprobs=[entry("c")])])]
    assert [f["choices"][0]["logprobs"]["text_offset"] for f in frames[:2]] == [[0, 1], [2]]
    assert frames[-1] == "[DONE]"


def test_an_openai_stream_error_keeps_the_code_and_request_id():
    (_, frame), = parse([openai.Chat("c", "m", 7, request_id="req_9").error_frame(
        {"message": "gone", "code": "worker_died", "status": 503, "retry": True})])
    assert frame == {"error": {"message": "gone", "type": "server_error", "param": None, "code": "worker_died",
                               "retry": True}, "request_id": "req_9"}


# --- Anthropic ----------------------------------------------------------------------------------

def test_a_message_stream_holds_blank_text_then_sends_calls_as_blocks():
    out = anthropic.Message("msg_1", "m")
    frames = run(out, [delta("\n"), delta("Hi"), delta("", tool_calls=[CALL]), done("\nHi", "tool_calls", [CALL])])
    names = [(name, data.get("index")) for name, data in frames]
    assert names == [("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert frames[2][1]["delta"] == {"type": "text_delta", "text": "\nHi"}  # the held line break goes first
    assert json.loads(frames[5][1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert frames[7][1]["delta"]["stop_reason"] == "tool_use" and frames[7][1]["usage"]["output_tokens"] == 5
    body = out.body(done("\nHi", "tool_calls", [CALL])["data"])
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"] and body["content"][1]["id"] == "toolu_ab12"


def test_a_message_reports_its_stop_sequence():
    body = anthropic.message("msg_1", "m", done("Par", stop_sequence="is")["data"])
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "is")
    assert anthropic.message("msg_1", "m", done("Par", "length")["data"])["stop_reason"] == "max_tokens"


def test_anthropic_errors_name_their_field_in_the_message():
    (name, frame), = parse([anthropic.Message("msg_1", "m").error_frame(
        {"status": 400, "message": "must be an object", "param": "tools.0"})])
    assert name == "error" and frame == {"type": "error", "error": {"type": "invalid_request_error",
                                                                    "message": "tools.0: must be an object"}}


# --- the error envelope -------------------------------------------------------------------------

@pytest.mark.parametrize("path, anthropic_shape", [("/v1/messages", True), ("/v1/messages/x", True),
                                                   ("/v1/responses", False), ("/v1/chat/completions", False)])
def test_each_path_answers_errors_in_its_apis_envelope(path, anthropic_shape):
    body = error_body(path, 503, {"message": "busy", "code": "queue_full", "param": None}, "req_1")
    if anthropic_shape:
        assert body == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"},
                        "request_id": "req_1"}
    else:
        assert body == {"error": {"message": "busy", "type": "service_unavailable_error", "param": None,
                                  "code": "queue_full"}, "request_id": "req_1"}


# --- Responses ----------------------------------------------------------------------------------

ECHO = responses.echo({"model": "m", "instructions": "Be brief.", "store": True, "tools": None}, 1700000000)


def test_a_responses_stream_is_numbered_and_completes_with_the_plain_object():
    out = responses.Responses("resp_1", ECHO)
    finished = done(" Hello", calls=None)
    frames = run(out, [delta(" "), delta("Hello"), finished])
    kinds = [name for name, _ in frames]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [data["sequence_number"] for _, data in frames] == list(range(len(frames)))
    assert frames[4][1]["delta"] == " Hello"  # the leading space, held until the text began, then sent with it
    assert frames[-1][1]["response"] == responses.Responses("resp_1", ECHO).body(finished["data"])
    assert frames[-1][1]["response"]["instructions"] == "Be brief." and frames[0][1]["response"]["status"] == "in_progress"


def test_a_responses_call_comes_after_the_text_as_a_function_call_item():
    out = responses.Responses("resp_1", ECHO)
    frames = run(out, [delta("", tool_calls=[CALL]), done("\n", "tool_calls", [CALL])])
    kinds = [name for name, _ in frames]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    assert frames[2][1]["item"]["arguments"] == "" and frames[3][1]["delta"] == CALL["arguments"]
    assert [i["type"] for i in frames[-1][1]["response"]["output"]] == ["function_call"]


def test_a_response_cut_by_its_token_limit_is_incomplete():
    body = responses.Responses("resp_1", ECHO).body(done("Once upon", "length")["data"])
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 4}


def record(status: str, error: dict | None = None) -> dict:
    return {"id": "resp_1", "status": status, "error": error, "response": {**ECHO, "background": True}}


@pytest.mark.parametrize("status, shown", [(records.QUEUED, "queued"), (records.RUNNING, "in_progress"),
                                           (records.CANCELED, "cancelled")])
def test_a_stored_response_shows_its_records_status(status, shown):
    response = responses.from_record(record(status), None)
    assert response["status"] == shown and response["output"] == [] and response["error"] is None
    assert response["background"] is True and response["created_at"] == 1700000000


def test_a_stored_response_shows_its_result_or_its_error():
    succeeded = responses.from_record(record(records.SUCCEEDED), done("Hi")["data"])
    assert succeeded["status"] == "completed" and succeeded["output"][0]["content"][0]["text"] == "Hi"
    assert succeeded == {**responses.Responses("resp_1", {**ECHO, "background": True}).body(done("Hi")["data"])}
    failed = responses.from_record(record(records.FAILED, {"code": "worker_died", "message": "gone"}), None)
    assert failed["status"] == "failed" and failed["error"] == {"code": "worker_died", "message": "gone"}


def test_a_responses_stream_error_is_its_own_event():
    (name, frame), = parse([responses.Responses("resp_1", ECHO).error_frame({"code": "timeout", "message": "late"})])
    assert name == "error" and frame == {"type": "error", "code": "timeout", "message": "late", "param": None,
                                         "sequence_number": 0}


# --- transcripts and async jobs -----------------------------------------------------------------

def test_transcript_deltas_start_without_a_space_and_end_with_the_text():
    out = transcripts.Transcript()
    segment = lambda text: {"type": SEGMENT, "data": {"segment": {"text": text}}}  # noqa: E731
    frames = [data for _, data in run(out, [segment(" "), segment(" Hello"), segment(" world."),
                                            {"type": DONE, "data": {"result": {"text": "Hello world."}}}])]
    assert frames == [{"type": "transcript.text.delta", "delta": "Hello"},
                      {"type": "transcript.text.delta", "delta": " world."},
                      {"type": "transcript.text.done", "text": "Hello world."}]


def test_a_transcript_answer_is_served_in_its_format():
    result = {"task": "transcribe", "language": "en", "duration": 1.0, "text": "Hi.",
              "segments": [{"id": 0, "start": 0.0, "end": 1.0, "text": " Hi."}]}
    with Flask(__name__).app_context():
        srt = transcripts.Transcript("srt").answer({"result": result})
        assert srt.mimetype == "application/x-subrip" and "00:00:00,000 --> 00:00:01,000" in srt.get_data(True)
        assert transcripts.Transcript("json").answer({"result": result}).get_json() == {"text": "Hi."}


def test_a_job_event_frame_carries_its_id_and_type():
    frame = jobs.event_frame({"id": 3, "type": "progress", "data": {"done_s": 1.5}})
    assert frame == 'id: 3\nevent: progress\ndata: {"done_s":1.5}\n\n'


def test_an_async_chat_result_is_a_chat_completion():
    result = {**done("Hi")["data"], "created": 5}
    body = jobs.result_body({"id": "job_1", "kind": "chat", "created_at": 4.2, "model": "m"}, result)
    assert body["object"] == "chat.completion" and body["id"] == "job_1" and body["created"] == 5
    assert jobs.result_body({"kind": "transcription"}, {"text": "x"}) == {"text": "x"}


# --- Reasoning ----------------------------------------------------------------------------------

def thought(text: str, index: int = 0) -> dict:
    return {"type": REASONING, "data": {"text": text, "index": index}}


def test_a_chat_streams_reasoning_before_content_and_answers_with_it_apart():
    out = openai.Chat("chatcmpl-1", "m", 7)
    final = done("4", reasoning="2 + 2 is 4.", reasoning_tokens=9)
    frames = [data for _, data in run(out, [thought("2 + 2"), thought(" is 4."), delta("4"), final])][:-1]
    deltas = [f["choices"][0]["delta"] for f in frames]
    assert deltas[:4] == [{"role": "assistant", "content": ""},
                          {"reasoning_content": "2 + 2", "reasoning": "2 + 2"},
                          {"reasoning_content": " is 4.", "reasoning": " is 4."}, {"content": "4"}]
    message = out.body(final["data"])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 is 4.",
                       "reasoning": "2 + 2 is 4."}


def test_a_responses_stream_gives_the_reasoning_item_first_then_the_message_at_index_1():
    out = responses.Responses("resp_1", responses.echo({"model": "m"}, 7))
    final = done("4", reasoning="2 + 2 is 4.")
    events = [data for _, data in run(out, [thought("2 + 2"), thought(" is 4."), delta("4"), final])]
    kinds = [e["type"] for e in events]
    assert kinds[2:8] == ["response.output_item.added", "response.reasoning_summary_part.added",
                          "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
                          "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]
    assert events[8]["type"] == "response.output_item.done" and events[8]["item"]["type"] == "reasoning"
    assert events[7]["part"]["text"] == "2 + 2 is 4."
    message = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(e["delta"], e["output_index"]) for e in message] == [("4", 1)]
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["summary"] == [{"type": "summary_text", "text": "2 + 2 is 4."}]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_messages_stream_gives_a_thinking_block_then_the_text_block():
    out = anthropic.Message("msg_1", "m")
    final = done("4", reasoning="2 + 2 is 4.")
    events = [data for _, data in run(out, [thought("2 + 2 is 4."), delta("4"), final])]
    blocks = [(e["type"], e.get("index"), e.get("content_block", e.get("delta"))) for e in events[1:6]]
    assert blocks == [("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
                      ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "2 + 2 is 4."}),
                      ("content_block_stop", 0, None),
                      ("content_block_start", 1, {"type": "text", "text": ""}),
                      ("content_block_delta", 1, {"type": "text_delta", "text": "4"})]
    assert out.body(final["data"])["content"] == [{"type": "thinking", "thinking": "2 + 2 is 4.", "signature": ""},
                                                  {"type": "text", "text": "4"}]
