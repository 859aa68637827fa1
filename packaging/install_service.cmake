# Installs kvtierd's systemd unit and config with the paths of the prefix
# being installed to (cmake --install --prefix P, or CPack's /usr), not the
# configure-time one: /etc for the /usr prefix, P/etc otherwise.
# Expects KVT_SRC (the source dir) and KVT_SBINDIR, KVT_DOCDIR (relative).
set(p "${CMAKE_INSTALL_PREFIX}")
if(p STREQUAL "/usr")
  set(etc "/etc")
else()
  set(etc "${p}/etc")
endif()
file(READ "${KVT_SRC}/packaging/kvtierd.service.in" unit)
string(REPLACE "@CMAKE_INSTALL_FULL_SBINDIR@" "${p}/${KVT_SBINDIR}" unit "${unit}")
string(REPLACE "@CMAKE_INSTALL_FULL_DOCDIR@" "${p}/${KVT_DOCDIR}" unit "${unit}")
string(REPLACE "@KVTIER_FULL_SYSCONFDIR@" "${etc}" unit "${unit}")
string(REPLACE "@KVTIER_FULL_SYSUSERSDIR@" "${p}/lib/sysusers.d" unit "${unit}")
string(REPLACE "@KVTIER_FULL_TMPFILESDIR@" "${p}/lib/tmpfiles.d" unit "${unit}")
set(udir "$ENV{DESTDIR}${p}/lib/systemd/system")
file(MAKE_DIRECTORY "${udir}")
file(WRITE "${udir}/kvtierd.service" "${unit}")
message(STATUS "Installing: ${udir}/kvtierd.service")
# file(INSTALL) adds DESTDIR itself
file(INSTALL "${KVT_SRC}/packaging/kvtierd.conf" DESTINATION "${etc}/kvtier")
# the service's user (sysusers.d) and its segment directory (tmpfiles.d)
file(INSTALL "${KVT_SRC}/packaging/kvtier.sysusers.conf" DESTINATION "${p}/lib/sysusers.d"
     RENAME kvtier.conf)
file(INSTALL "${KVT_SRC}/packaging/kvtier.tmpfiles.conf" DESTINATION "${p}/lib/tmpfiles.d"
     RENAME kvtier.conf)
