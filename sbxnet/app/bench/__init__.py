"""``sbxnet bench``: the staged throughput benchmark (issue 13).

It lives under ``sbxnet/app/`` because it wires the components together (a gateway in front of a
forwarder or of an L7 hop), which only ``sbxnet/app/`` may do, and because the console script reaches
it there. It runs from a checkout: the peers it measures against (nginx and HAProxy set-ups, the
forwarder-hop and splice runners) are the scripts under ``bench/``, imported from the checkout
(``checkout.py``), so each arm is started and accounted the same way as in those scripts.

Modules: ``cli`` (the subcommand), ``plan`` (arms, workloads, modes), ``arms`` (starting them),
``workloads`` (one trial of each kind), ``run`` (interleaving and progress), ``report`` (JSON, Markdown,
PNG), ``http_app`` (the sandbox app), ``l7_hop`` (our L7 hop), ``http_peer`` (HTTP/1.1 framing both
share), ``profile`` (a py-spy profile of a run, summed per process and category).
"""
