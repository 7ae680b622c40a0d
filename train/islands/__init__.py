"""Islands: periodic schemes across processes that fail, on Ray (DESIGN §12).

An island is one JAX program (a Ray actor with its own virtual CPU devices)
holding a whole replica and running DiLoCo's inner steps; islands exchange
only their compressed outer payloads, through Ray's object store. Modules,
one purpose each:

* ``settings`` -- ``config.islands``, checked;
* ``plan`` -- the failure plan of ``islands.inject``;
* ``quorum`` -- when a round closes (quorum and grace window);
* ``payload`` -- the payload and its validation;
* ``hashing`` -- the state hash compared every round;
* ``wire`` -- a registered compressor cut at its wire (encode / decode-mean);
* ``replica`` -- one island's JAX program (inner steps, outer step, joins);
* ``actor`` -- the Ray actor around a replica;
* ``coordinator`` -- the rounds: quorum, stragglers, joins, hash checks;
* ``checkpoint`` -- the outer Orbax checkpoint and elastic resume;
* ``records`` -- ``islands.jsonl``;
* ``run`` -- ``train_and_evaluate``, the entry point of ``python -m train``
  for a config with an ``islands`` field.
"""
