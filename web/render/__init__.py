"""The output package: every wire shape mlxq answers in, one module per API, all on one interface.

Each API's module holds a Renderer (web/render/base.py) that turns one job's events into that API's
frames and its final body, side by side, so a field is added once per API and nowhere else:

- openai.py: chat.completion(.chunk) and text_completion, and OpenAI's error envelope
- anthropic.py: the Messages API's `message`, its event stream and its error envelope
- responses.py: the Responses API's `response` object (live, or from its job's record) and its events
- transcripts.py: transcriptions in their formats (jobs/formats.py) and their text deltas
- jobs.py: the async jobs API's raw event frames and results
- sse.py: Server-Sent Events framing (nothing outside this package frames SSE)
- errors.py: which API's error envelope a request is answered in

Views only choose a renderer and hand it to web/jobrun.py, which feeds it the job's events.
"""
