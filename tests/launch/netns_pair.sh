# Sourced by the tests that play two machines (tests/launch/two_machines*.sh,
# tests/distributed/hier/hier_two_namespaces.sh): two network namespaces joined by a veth pair.
# netns_pair PREFIX: creates "${PREFIX}n0_<pid>" and "${PREFIX}n1_<pid>" with addresses $addr0 and
# $addr1 on one /24, sets ns0 ns1 veth0 veth1 addr0 addr1 and work (a temporary directory), and
# removes all of it on exit. Needs root; fails the test (fail(), defined by the caller) without.
netns_pair() {
  local prefix=$1
  [ "$(id -u)" -eq 0 ] || fail "needs root to create network namespaces (run as root)"
  command -v ip > /dev/null || fail "'ip' not found (install iproute2: scripts/install-deps.sh)"
  # Names unique to this run (interface names have at most 15 characters).
  local id=$$
  ns0=${prefix}n0_$id
  ns1=${prefix}n1_$id
  veth0=${prefix}v0_$id
  veth1=${prefix}v1_$id
  local subnet=10.231.$((id % 250 + 1))
  addr0=$subnet.1
  addr1=$subnet.2
  work=$(mktemp -d)
  trap 'ip netns del "$ns0" 2> /dev/null; ip netns del "$ns1" 2> /dev/null;
        ip link del "$veth0" 2> /dev/null; rm -rf "$work"' EXIT
  ip netns add "$ns0" || fail "'ip netns add $ns0' failed (needs CAP_SYS_ADMIN)"
  ip netns add "$ns1" || fail "'ip netns add $ns1' failed"
  ip link add "$veth0" type veth peer name "$veth1" || fail "cannot create a veth pair"
  ip link set "$veth0" netns "$ns0" || fail "cannot move $veth0 into $ns0"
  ip link set "$veth1" netns "$ns1" || fail "cannot move $veth1 into $ns1"
  ip -n "$ns0" addr add "$addr0/24" dev "$veth0" || fail "cannot address $veth0"
  ip -n "$ns1" addr add "$addr1/24" dev "$veth1" || fail "cannot address $veth1"
  local n
  for n in "$ns0" "$ns1"; do ip -n "$n" link set lo up || fail "cannot bring up lo in $n"; done
  ip -n "$ns0" link set "$veth0" up || fail "cannot bring up $veth0"
  ip -n "$ns1" link set "$veth1" up || fail "cannot bring up $veth1"
}
