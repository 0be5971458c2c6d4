"""`qserve bench`: drive an OpenAI-compatible server with streaming requests and measure it."""
