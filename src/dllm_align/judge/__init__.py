"""Stage 6, judging: inputs and pairing (`inputs`), the OpenAI-style client and its transport (`client`), the
judgement cache (`cache`), the Batch API (`batch`), the protocol that judges both orders and the rule judges (`run`),
the LC-AWR's length anchors and difficulty term (`anchors`),
the report (`report`) and the statistics (`stats`: AWR, length control, bootstrap, majority vote, kappa).

May import: `core`, `config`, `data`.
"""
