# llama_server_unified_share: the patched llama-server (LLAMA_SERVER_KVSHARE=path, from
# scripts/build-llama-server.sh --with-kvshare) with --kv-unified -np 3 hands over slots 1
# and 2 as runs of cells it reserves in the one stream (share with ids, llama-kvshare-prefill
# --first-cell C --cells N, adopt) while slot 0 streams; the provider writes no other byte;
# adopt after erase, a share with no free run (503) and one without ids (501) are refused
# (issue #27). Exit 77 = skipped.
add_test(NAME llama_server_unified_share
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/llama_server_unified_share.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_unified_share PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS llama_server)
