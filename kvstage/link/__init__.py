"""Link facts and their judgement: which path a peer's bytes take, and whether
it is the best this hardware offers.

Low in the package (below ``transports``), so the transports and the protocol
judge each link at connect with the same rules ``kvstage probe`` uses:

- ``facts``: this process's facts (GPUs, NVLink, RDMA, UCX, the memory of a
  buffer), each labelled with its source (``finding.fact``);
- ``context``: two sides' facts as one link (same host, same GPU, NVLink);
- ``assess``: the severity rule, facts + the transport's selection -> ``Finding``;
- ``connect``: the one line an endpoint logs per peer;
- ``ucx_info`` / ``paths``: UCX's protocol tables and the path names.
"""
