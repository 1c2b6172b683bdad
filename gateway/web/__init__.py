"""HTTP concerns every route shares: API keys, CORS, Host and page guards, connection limits, OpenAI-shaped errors,
the in-flight limit (429 past it) and the Prometheus metrics. Imports no other wing of the gateway."""
