"""The ecosystem's decision wire formats, translated onto semif-serve's own shared scoring.

`systemone` (TypeSafe's System One, `POST /v1/systemone`) and `decisions` (OpenAI Decisions,
`POST /v1/decisions`) each turn a request into `mapping.Mapped` questions over one state, and
the service's results back into their reply; `mapping` holds what both share. Pure Python: no
torch, no HTTP. The HTTP layer (`http.ecosystem`) runs the shared calls through the same
`DecisionService` as `/decide/shared`.
"""
