"""The OpenAI endpoints (chat, completions, Responses, tokenize) and what they share: the request protocol, the
server state and a request's generation, tools, structured outputs, detokenizing and the OpenAPI document."""
