"""The gateway's side of the engine processes: spawning one and watching it (`process`), its frames in and out
(`client`), several replicas behind one front (`replicas`) and which replica serves a request (`routing`)."""
