"""Process plumbing: the zygote that forks fleet processes, compute lanes, the gc policy, the
event loop, host addresses and devices. Design: docs/design/startup.md.
"""
