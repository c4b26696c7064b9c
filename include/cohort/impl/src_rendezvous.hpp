#pragma once
// A part of cohort/src.hpp: the stores, the launchers' variables, and the file and digest
// code they share with the checkpoints.
#if !defined(COHORT_SEPARATE_COMPILATION)
#error "cohort/impl/src_rendezvous.hpp, a part of cohort/src.hpp, needs COHORT_SEPARATE_COMPILATION everywhere"
#endif
#include "cohort/config.hpp"
#include "cohort/impl/files.ipp"
#include "cohort/impl/sha256.ipp"
#include "cohort/rendezvous/impl/file_store.ipp"
#include "cohort/rendezvous/impl/hmac.ipp"
#include "cohort/rendezvous/impl/launch.ipp"
#include "cohort/rendezvous/impl/store.ipp"
#include "cohort/rendezvous/impl/tcp_socket.ipp"
#include "cohort/rendezvous/impl/tcp_store.ipp"
#include "cohort/rendezvous/impl/tcp_store_protocol.ipp"
#include "cohort/rendezvous/impl/tcp_store_server.ipp"
