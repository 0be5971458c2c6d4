"""Online half of qserve: models, engine, server and command line."""
