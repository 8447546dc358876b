# llama_server_slots_share: the patched llama-server (LLAMA_SERVER_KVSHARE=path, from
# scripts/build-llama-server.sh --with-kvshare) with -np 3 and one KV stream per slot hands
# over slots 1 and 2 (two shares, two llama-kvshare-prefill --stream runs, two adopts) while
# slot 0 generates; a unified cache refuses slot 1 with 501 (issue #27). Exit 77 = skipped.
add_test(NAME llama_server_slots_share
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/llama_server_slots_share.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_slots_share PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS llama_server)
